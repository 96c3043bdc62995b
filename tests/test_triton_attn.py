"""The Triton paged-attention kernels against the torch reference backend.

Run in Triton's interpreter (``TRITON_INTERPRET=1``, set below and by the kernels
module itself when there is no GPU), on shapes small enough for numpy. Each step
is run twice, on two copies of the same garbage-filled cache: once by the
reference, once by the Triton backend; outputs and the written caches must agree.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from test_attention_ref import (
    NUM_BLOCKS,
    WINDOW_STEPS,
    forget_skipped_blocks,
    garbage_cache,
    make_sequences,
    run_against_reference,
)

from nanoengine.attention.backends.triton_attn import TritonAttentionImpl, token_to_request
from nanoengine.attention.backends.triton_kernels import paged_attention, reshape_and_cache


def run_both(seqs, steps, caches):  # type: ignore[no-untyped-def]
    """One batch through the reference and the Triton backend (each on its own cache copy)."""
    return run_against_reference(TritonAttentionImpl(), seqs, steps, caches)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_prefill_then_decodes_match_reference(num_kv_heads: int) -> None:
    seqs = make_sequences([6, 9], num_heads=4, num_kv_heads=num_kv_heads)
    cache = garbage_cache(num_kv_heads)
    caches = (cache.clone(), cache.clone())
    run_both(seqs, [(0, 5), (1, 7)], caches)
    for _ in range(1):
        run_both(seqs, [(0, 1), (1, 1)], caches)


def test_chunked_prefill_and_mixed_batch_match_reference() -> None:
    seqs = make_sequences([10, 5], num_heads=4, num_kv_heads=2)
    cache = garbage_cache(2)
    caches = (cache.clone(), cache.clone())
    run_both(seqs, [(0, 3)], caches)  # first chunk, ends mid-block
    run_both(seqs, [(0, 6), (1, 4)], caches)  # second chunk over cached blocks + a prompt
    run_both(seqs, [(0, 1), (1, 1)], caches)  # decodes crossing into a new block


@pytest.mark.parametrize("sliding_window", [1, 8])
def test_sliding_window_matches_reference(sliding_window: int) -> None:
    """The blocks before each window point at garbage: the kernel starts at the window's block."""
    seqs = make_sequences([33, 24, 12], num_heads=4, num_kv_heads=2)
    cache = garbage_cache(2, num_blocks=NUM_BLOCKS + 1)
    caches = (cache.clone(), cache.clone())
    for steps in WINDOW_STEPS:
        run_against_reference(TritonAttentionImpl(), seqs, steps, caches, sliding_window=sliding_window)
        forget_skipped_blocks(seqs, sliding_window, foreign_block=NUM_BLOCKS)


def test_padding_rows_write_nothing_and_return_zero() -> None:
    # A CUDA-graph batch of 4 rows carrying 2 real decodes: rows 2-3 point at a
    # request with seq_len 0 and slot -1.
    num_blocks, block_size, heads, kv_heads, dim = 6, 4, 2, 1, 12  # dim 12: not a power of two
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    before = cache.clone()
    key = torch.randn(4, kv_heads, dim)
    slots = torch.tensor([5, 9, -1, -1])
    reshape_and_cache(key, key, cache, slots)
    assert torch.equal(cache[0].flatten(0, 1)[5], key[0]) and torch.equal(cache[1].flatten(0, 1)[9], key[1])
    changed = (cache != before).flatten(1, 2).flatten(2).any(-1).flatten()  # [2 * 24] per K/V slot
    assert changed.nonzero().flatten().tolist() == [5, 9, 5 + 24, 9 + 24]
    out = paged_attention(
        torch.randn(4, heads, dim),
        cache,
        block_table=torch.tensor([[1, 0], [2, 0], [0, 0], [0, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([2, 2, 0, 0], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32),
        token_to_req=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        scale=dim**-0.5,
    )
    assert out[:2].abs().sum() > 0 and not out.isnan().any()
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_token_to_request_follows_query_start_loc() -> None:
    qsl = torch.tensor([0, 1, 2, 5, 9], dtype=torch.int32)
    assert token_to_request(qsl, 9).tolist() == [0, 1, 2, 2, 2, 3, 3, 3, 3]
