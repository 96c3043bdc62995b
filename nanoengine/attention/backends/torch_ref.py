"""The reference paged-attention backend: plain torch, readable, any device.

Chapter 7 (what "attention over a paged KV cache" actually computes); chapter 4
explains the block table and slot mapping it reads.
vLLM 0.32 counterpart: ``vllm/v1/attention/backends/`` — closest in spirit is
``cpu_attn.py`` (``CPUAttentionBackendImpl``); ``flash_attn.py`` does the same job
with one fused CUDA kernel.

One step's batch is flattened: decodes first (one query each), then prefills or
prefill chunks. The backend does two things:

1. **Write**: this step's K/V rows go to their cache slots
   (``slot_mapping[t] = block_id * block_size + offset``).
2. **Read and attend**: each request gathers its K/V from the blocks listed in
   its block-table row, positions ``0 .. seq_len - 1``, and attends to them.

Decodes are batched into one ``scaled_dot_product_attention`` call (padded to the
longest ``seq_len``, masked beyond each request's own); prefills run one request
at a time with a causal mask shifted by the tokens already in the cache, which is
what makes chunked prefill and prefix-cache hits correct.

A sliding-window layer (chapter 4) passes ``sliding_window``: the query at
position ``p`` then reads only keys ``p - sliding_window + 1 .. p``, itself
included, as HF transformers and vLLM count it. The reference still gathers
every block of the table and masks the keys outside the window; entries the
scheduler gave back are stale or the null block, always finite, and masked.

Padding positions of the decode batch hold stale K/V of other requests (or the
zeros of a never-written slot). The mask gives them softmax weight exactly 0, which
is enough because every slot is *finite*: the model runner allocates the cache
with ``torch.zeros`` and only finite K/V are ever written (``0 * NaN`` would still
be NaN, so a cache from ``torch.empty`` would not be safe here). Prefills only
ever gather valid positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.utils.math_utils import cdiv


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into their slots.

    ``kv_cache`` is [2, num_blocks, block_size, num_kv_heads, head_dim]; a slot
    id names block ``slot // block_size``, row ``slot % block_size``. The write
    indexes (block, row) rather than flattening the two dims into one slot
    dim: a hybrid model's attention cache keeps K and V of one block side by
    side (see ``worker/kv_cache_tensors.py``), and its blocks then cannot be viewed
    as one run of rows -- flattening would silently write into a copy.
    """
    block_size = kv_cache.shape[2]
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[0].index_put_((blocks, rows), key.to(kv_cache.dtype))
    kv_cache[1].index_put_((blocks, rows), value.to(kv_cache.dtype))


def gather_kv(cache_half: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The K (or V) of whole blocks, laid end to end.

    cache_half [num_blocks, block_size, H, D]; block_ids [..., n] ->
    [..., n * block_size, H, D], token position p of the request at row p.
    """
    # index_select on [num_blocks, block_size * H * D] rows copies whole blocks
    # with one memcpy each; advanced indexing (cache_half[block_ids]) takes a
    # generic per-element gather path, about 10x slower on CPU for decode batches.
    rows = cache_half.flatten(1).index_select(0, block_ids.flatten().long())
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * cache_half.shape[1], *cache_half.shape[2:])


class TorchRefAttentionImpl:
    """Write-then-attend over the paged cache, as described in the module docstring."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D]; key/value [T, Hkv, D]; returns [T, Hq, D].

        Rows past ``num_actual_tokens`` (padding a runner may add) come back zero.
        ``sliding_window``: how many keys back a query reads, itself included
        (None: all of them).
        """
        n = attn_metadata.num_actual_tokens
        self._write(key[:n], value[:n], kv_cache, attn_metadata.slot_mapping[:n])
        num_decodes = attn_metadata.num_decodes
        if num_decodes == attn_metadata.num_reqs == query.shape[0]:
            # A pure decode batch with no padding, the common step: no output
            # buffer to zero and copy into.
            return self._decode_batch(query, kv_cache, attn_metadata, scale, sliding_window)
        # Dense [T, Hq, D] (query is usually a strided view of the qkv output):
        # a kernel may write its rows through plain offsets.
        output = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        if num_decodes > 0:
            # Decodes come first and own exactly one row each: rows 0 .. num_decodes-1.
            output[:num_decodes] = self._decode_batch(
                query[:num_decodes], kv_cache, attn_metadata, scale, sliding_window
            )
        if num_decodes < attn_metadata.num_reqs:
            self._prefill_batch(output, query, kv_cache, attn_metadata, scale, sliding_window)
        return output

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store this step's K/V; a faster backend may override it (and the two below)."""
        write_to_kv_cache(key, value, kv_cache, slot_mapping)

    def _decode_batch(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """All decode requests in one SDPA call. query [num_decodes, Hq, D]."""
        num_decodes = query.shape[0]
        block_size = kv_cache.shape[2]
        seq_lens = md.seq_lens[:num_decodes].long()  # [num_decodes]
        max_len = max(md.seq_lens_cpu[:num_decodes])
        num_blocks = cdiv(max_len, block_size)
        block_ids = md.block_table[:num_decodes, :num_blocks]  # [num_decodes, num_blocks]
        # [num_decodes, max_len, Hkv, D]: each row padded to the longest request
        keys = gather_kv(kv_cache[0], block_ids)[:, :max_len]
        values = gather_kv(kv_cache[1], block_ids)[:, :max_len]
        # [num_decodes, max_len] True where the position really holds this request's K/V
        key_pos = torch.arange(max_len, device=query.device)[None, :]
        valid = key_pos < seq_lens[:, None]
        if sliding_window is not None:
            # The query sits at seq_len - 1 and reads back sliding_window keys, itself included.
            valid &= key_pos >= seq_lens[:, None] - sliding_window
        out = F.scaled_dot_product_attention(
            query[:, :, None, :],  # [num_decodes, Hq, 1, D]
            keys.transpose(1, 2),  # [num_decodes, Hkv, max_len, D]
            values.transpose(1, 2),
            attn_mask=valid[:, None, None, :],  # [num_decodes, 1, 1, max_len]
            scale=scale,
            enable_gqa=True,
        )
        return out[:, :, 0, :]  # [num_decodes, Hq, D]

    def _prefill_batch(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        """Fill the rows of every prefill request (those after the decodes) of ``output``."""
        qsl = md.query_start_loc_cpu
        for i in range(md.num_decodes, md.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            output[start:end] = self._prefill_one(query[start:end], kv_cache, md, i, scale, sliding_window)

    def _prefill_one(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        req: int,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """One prefill (or chunk) of request ``req``. query [q_len, Hq, D]."""
        q_len = query.shape[0]
        seq_len = md.seq_lens_cpu[req]
        num_context = seq_len - q_len  # tokens cached by earlier steps (or a prefix hit)
        block_size = kv_cache.shape[2]
        block_ids = md.block_table[req, : cdiv(seq_len, block_size)]
        # [seq_len, Hkv, D]; every position here was written, this step or before
        keys = gather_kv(kv_cache[0], block_ids)[:seq_len]
        values = gather_kv(kv_cache[1], block_ids)[:seq_len]
        if num_context == 0 and sliding_window is None:
            # A fresh prompt: the usual square causal mask, which SDPA builds itself.
            mask = None
        else:
            # Query j sits at position num_context + j and sees keys 0 .. that position,
            # or, in a sliding window, only the last sliding_window of them.
            query_pos = num_context + torch.arange(q_len, device=query.device)
            key_pos = torch.arange(seq_len, device=query.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
            if sliding_window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],  # [1, Hq, q_len, D]
            keys.transpose(0, 1)[None],  # [1, Hkv, seq_len, D]
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)  # [q_len, Hq, D]
