# mypy: disallow-untyped-defs=False
# (Triton reads a kernel's annotations as specialisation hints, so the @triton.jit
# kernels below stay unannotated; their typed Python wrappers are checked.)
"""Triton kernels for paged attention: write K/V into their slots, then attend.

Chapter 7 (the forward pass on a GPU). These compute exactly what the torch
reference backend (``torch_ref.py``) computes, in two kernels:

* ``reshape_and_cache``: one program per scheduled token copies its K and V rows
  into cache slot ``slot_mapping[t]``. A negative slot means "padding" (a CUDA
  graph replayed for a larger batch than the real one) and is skipped.
* ``paged_attention``: one program per (query token, query head). It finds the
  token's request, walks that request's block table block by block and keeps a
  running ("online") softmax, so no [query, key] score matrix is ever stored.
  Decodes, whole prefills and prefill chunks over cached blocks are the same
  loop: a query at position ``p`` reads keys ``0 .. p``.

Every launch reads its sizes from device tensors, never from Python numbers, so a
CUDA graph captured once can be replayed with new metadata in the same buffers.

vLLM 0.32 counterpart: ``vllm/v1/attention/ops/triton_unified_attention.py``
(``unified_attention``, one kernel for prefill and decode) and
``triton_reshape_and_cache_flash.py``.

Without a GPU Triton can only run a kernel in its interpreter (``TRITON_INTERPRET=1``,
numpy underneath, slow). The flag is read when a kernel is *defined*, so on a
machine without CUDA this module turns it on before defining its kernels; the
CPU tests run the kernels that way on small shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from nanoengine.attention.backends.abstract import kernel_window


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_value_token,
    stride_cache_block,
    stride_cache_slot,
    block_size,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: one token's K (or V) row
    ROW_P: tl.constexpr,  # ROW rounded up to a power of two (tl.arange needs one)
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offsets = tl.arange(0, ROW_P)
        mask = offsets < ROW
        # Slot -> (block, row in block): blocks need not be adjacent in memory
        # (a hybrid model's shared pages put a block's V right after its K).
        where = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot
        key = tl.load(key_ptr + token * stride_key_token + offsets, mask=mask)
        value = tl.load(value_ptr + token * stride_value_token + offsets, mask=mask)
        tl.store(key_cache_ptr + where + offsets, key, mask=mask)
        tl.store(value_cache_ptr + where + offsets, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D].

    ``slot_mapping`` [T] int64; a slot < 0 leaves the cache untouched. Each
    block's [block_size, Hkv, D] rows must be contiguous; the blocks themselves
    may lie any fixed stride apart.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    key = key.contiguous()
    value = value.contiguous()
    key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D] each
    if not key_cache[0].is_contiguous():
        raise ValueError(
            f"The Triton attention backend needs each block's rows contiguous; this cache has strides "
            f"{tuple(kv_cache.stride())} for shape {tuple(kv_cache.shape)}."
        )
    row = key.shape[1] * key.shape[2]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.shape[1],
        ROW=row,
        ROW_P=triton.next_power_of_2(row),
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    token_to_req_ptr,
    scale,
    sliding_window,  # keys a query reads back, itself included; 0: all of them
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table_row,
    QUERIES_PER_KV: tl.constexpr,  # GQA group size: Hq // Hkv
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_P: tl.constexpr,  # BLOCK_SIZE rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(token_to_req_ptr + token)
    query_end = tl.load(query_start_loc_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    # The request's last query sits at position seq_len - 1, so this one sits
    # (query_end - 1 - token) positions earlier and sees keys 0 .. position.
    num_keys = seq_len - (query_end - token) + 1
    # In a sliding window (chapter 4) the first key read is num_keys - sliding_window;
    # the loop starts at its block, so the blocks before it are never loaded.
    first_key = tl.where(sliding_window > 0, tl.maximum(num_keys - sliding_window, 0), 0)
    kv_head = head // QUERIES_PER_KV

    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    query = tl.load(
        query_ptr + token * stride_q_token + head * stride_q_head + dims, mask=dim_mask, other=0.0
    ).to(tl.float32)  # [HEAD_DIM_P]
    slots = tl.arange(0, BLOCK_P)
    # Running max, running denominator, running numerator of the online softmax;
    # built by reductions so they are float32 scalars from the first iteration on.
    running_max = tl.max(tl.full([BLOCK_P], float("-inf"), tl.float32), axis=0)
    running_sum = tl.sum(tl.zeros([BLOCK_P], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM_P], tl.float32)
    for block_start in range((first_key // BLOCK_SIZE) * BLOCK_SIZE, num_keys, BLOCK_SIZE):
        block_id = tl.load(block_table_ptr + req * stride_block_table_row + block_start // BLOCK_SIZE)
        key_pos = block_start + slots
        key_mask = (slots < BLOCK_SIZE) & (key_pos >= first_key) & (key_pos < num_keys)  # [BLOCK_P]
        # [BLOCK_P, HEAD_DIM_P] offsets of this block's K/V rows for our KV head
        offsets = (
            block_id.to(tl.int64) * stride_cache_block
            + slots[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
            + dims[None, :]
        )
        tile_mask = key_mask[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        scores = tl.sum(keys * query[None, :], axis=1) * scale  # [BLOCK_P]
        scores = tl.where(key_mask, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        # The first block always holds first_key, so new_max is finite from here on.
        probs = tl.exp(scores - new_max)
        rescale = tl.exp(running_max - new_max)
        values = tl.load(value_cache_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        running_sum = running_sum * rescale + tl.sum(probs, axis=0)
        acc = acc * rescale + tl.sum(probs[:, None] * values, axis=0)
        running_max = new_max
    # A padding token (no keys) leaves running_sum at 0: write zeros, not NaN.
    out = tl.where(running_sum > 0, acc / tl.maximum(running_sum, 1e-30), 0.0)
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_to_req: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of query [T, Hq, D] over the paged cache; returns [T, Hq, D].

    ``sliding_window``: each query reads only its last that many keys (None: all).

    ``token_to_req`` [T] int32 names each query row's request; ``seq_lens``
    [num_reqs] and ``query_start_loc`` [num_reqs + 1] are per request. A row whose
    request has no key at or before its position (padding) comes back zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D] views
    _paged_attention_kernel[(num_tokens, num_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        token_to_req,
        scale,
        kernel_window(sliding_window),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_P=triton.next_power_of_2(block_size),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
    )
    return out
