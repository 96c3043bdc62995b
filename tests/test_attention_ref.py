"""The torch reference paged-attention backend against dense causal attention.

Every scenario replays a sequence of engine steps (prefills, chunks, decodes,
mixed) over a paged cache whose blocks are shuffled and whose unwritten slots hold
large finite garbage, and checks each step's output rows against attention computed densely, in
float64, over each request's full sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from bf16_checks import BF16_ONE_ULP, BF16_RTOL, Tolerance
from torch import nn

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl
from nanoengine.attention.layer import Attention, AttentionImpl, bind_kv_cache

BLOCK_SIZE = 4
NUM_BLOCKS = 40
HEAD_DIM = 8
# A fast backend against the reference and the dense answer. fp32: summation
# order only. bf16: torch's SDPA rounds intermediate results (its probabilities)
# to bf16, so reference outputs (convex combinations of V, |V| ~ 1) sit up to
# ~1e-2 from the dense answer, and a fast backend's within that of both.
ATTENTION_TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1e-2, "rtol": BF16_RTOL},
}
# A C++ kernel computes in fp32 and rounds once on write: its bf16 rows are the
# dense answer rounded to bf16, within half a bf16 step (BF16_ONE_ULP is a whole one).
ROUNDED_ONCE: Tolerance = {"atol": 1e-5, "rtol": BF16_ONE_ULP}


def make_attn_metadata(
    num_computed: list[int], num_new: list[int], block_ids: list[list[int]], block_size: int
) -> AttentionMetadata:
    """Metadata for one step: request i already has num_computed[i] tokens cached
    and schedules num_new[i] more. Requests must be ordered decodes first."""
    num_decodes = next((i for i, n in enumerate(num_new) if n != 1), len(num_new))
    assert all(n != 1 for n in num_new[num_decodes:]), "decodes must come first"
    query_start_loc = [0]
    seq_lens: list[int] = []
    slots: list[int] = []
    for computed, new, blocks in zip(num_computed, num_new, block_ids):
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(computed + new)
        for pos in range(computed, computed + new):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(b) for b in block_ids)
    table = torch.zeros(len(block_ids), width, dtype=torch.int32)
    for row, blocks in enumerate(block_ids):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        num_reqs=len(num_new),
        num_decodes=num_decodes,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def allocate_blocks(lengths: list[int], block_size: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    """Disjoint, shuffled physical blocks for requests of these total lengths."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    out: list[list[int]] = []
    for length in lengths:
        need = math.ceil(length / block_size)
        out.append(perm[:need])
        perm = perm[need:]
    return out


@dataclass
class Sequence:
    """One request's full q/k/v, and how much of it the cache already holds."""

    q: torch.Tensor  # [L, Hq, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor
    blocks: list[int]
    computed: int = 0


def dense_reference(
    seq: Sequence, start: int, end: int, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Causal attention of query rows [start, end) over the whole sequence, float64
    (in a sliding window: over the last ``sliding_window`` keys of each query)."""
    group = seq.q.shape[1] // seq.k.shape[1]
    q = seq.q[start:end].double().transpose(0, 1)  # [Hq, n, D]
    k = seq.k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = seq.v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale  # [Hq, n, L]
    query_pos = torch.arange(start, end)[:, None]
    key_pos = torch.arange(seq.q.shape[0])[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    if sliding_window is not None:
        scores = scores.masked_fill(key_pos <= query_pos - sliding_window, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).float()  # [n, Hq, D]


def make_sequences(
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = NUM_BLOCKS,
) -> list[Sequence]:
    """Random q/k/v in ``dtype``; the dense reference widens these exact values to float64."""
    blocks = allocate_blocks(lengths, BLOCK_SIZE, num_blocks)
    return [
        Sequence(
            torch.randn(n, num_heads, head_dim).to(dtype),
            torch.randn(n, num_kv_heads, head_dim).to(dtype),
            torch.randn(n, num_kv_heads, head_dim).to(dtype),
            b,
        )
        for n, b in zip(lengths, blocks)
    ]


def garbage_cache(
    num_kv_heads: int, head_dim: int = HEAD_DIM, dtype: torch.dtype = torch.float32, num_blocks: int = NUM_BLOCKS
) -> torch.Tensor:
    # Large finite garbage everywhere (the engine's cache is zero-filled and only
    # finite K/V are written, so slots are never NaN): any unwritten or foreign slot
    # that leaks into a result moves it far from the dense reference.
    generator = torch.Generator().manual_seed(1234)
    shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=generator) * 1e3).to(dtype)


@dataclass
class StepBatch:
    """One scheduled batch: the chosen sequences, their new-token counts, metadata and q/k/v."""

    chosen: list[Sequence]
    num_new: list[int]
    md: AttentionMetadata
    q: torch.Tensor  # [num_tokens, Hq, D]
    k: torch.Tensor  # [num_tokens, Hkv, D]
    v: torch.Tensor


def step_batch(seqs: list[Sequence], steps: list[tuple[int, int]]) -> StepBatch:
    """Flatten (request index, num_new) pairs into one batch, as the model runner would."""
    chosen = [seqs[i] for i, _ in steps]
    num_new = [n for _, n in steps]
    md = make_attn_metadata([s.computed for s in chosen], num_new, [s.blocks for s in chosen], BLOCK_SIZE)

    def rows(field: str) -> torch.Tensor:
        return torch.cat([getattr(s, field)[s.computed : s.computed + n] for s, n in zip(chosen, num_new)])

    return StepBatch(chosen, num_new, md, rows("q"), rows("k"), rows("v"))


def run_step(
    seqs: list[Sequence], steps: list[tuple[int, int]], kv_cache: torch.Tensor, sliding_window: int | None = None
) -> None:
    """Schedule (request index, num_new) pairs as one batch and check every output row."""
    batch = step_batch(seqs, steps)
    chosen, num_new, md = batch.chosen, batch.num_new, batch.md
    scale = HEAD_DIM**-0.5
    out = TorchRefAttentionImpl().forward(batch.q, batch.k, batch.v, kv_cache, md, scale, sliding_window)
    assert not out.isnan().any()
    for row, (s, n) in enumerate(zip(chosen, num_new)):
        got = out[md.query_start_loc_cpu[row] : md.query_start_loc_cpu[row + 1]]
        want = dense_reference(s, s.computed, s.computed + n, scale, sliding_window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        s.computed += n


def run_against_reference(
    fast: AttentionImpl,
    seqs: list[Sequence],
    steps: list[tuple[int, int]],
    caches: tuple[torch.Tensor, torch.Tensor],
    rounded_once: bool = False,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One batch through the reference (on caches[0]) and a fast backend (on
    caches[1]): outputs, written caches and the dense answer must all agree.

    ``rounded_once``: every row of this batch comes from a kernel that rounds once
    (bf16), so each must also be the dense answer to half a bf16 step.
    ``sliding_window``: every query reads only its last that many keys."""
    batch = step_batch(seqs, steps)
    chosen, num_new, md = batch.chosen, batch.num_new, batch.md
    scale = batch.q.shape[-1] ** -0.5
    tolerance = ATTENTION_TOLERANCE[batch.q.dtype]
    ref = TorchRefAttentionImpl().forward(batch.q, batch.k, batch.v, caches[0], md, scale, sliding_window)
    got = fast.forward(batch.q, batch.k, batch.v, caches[1], md, scale, sliding_window)
    assert got.dtype == batch.q.dtype, f"{type(fast).__name__} gave {got.dtype} for {batch.q.dtype} inputs"
    torch.testing.assert_close(got, ref, **tolerance)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)  # a copy: bit for bit
    for row, (s, n) in enumerate(zip(chosen, num_new)):
        rows = got[md.query_start_loc_cpu[row] : md.query_start_loc_cpu[row + 1]]
        dense = dense_reference(s, s.computed, s.computed + n, scale, sliding_window)
        torch.testing.assert_close(rows.float(), dense, **(ROUNDED_ONCE if rounded_once else tolerance))
        s.computed += n
    return got


def forget_skipped_blocks(seqs: list[Sequence], sliding_window: int, foreign_block: int) -> None:
    """Do what the scheduler does to a sliding window's table: the blocks no later
    query reads are given back, here pointed at ``foreign_block`` (garbage that
    would ruin any output reading it), as a block another request now holds."""
    for seq in seqs:
        num_skipped_blocks = max(seq.computed - sliding_window + 1, 0) // BLOCK_SIZE
        seq.blocks[:num_skipped_blocks] = [foreign_block] * num_skipped_blocks


# Sliding-window steps (request index, tokens) over prompts of 30, 21 and 9
# tokens: prefills longer than the window, a chunk after a cached context, decodes
# whose window has left earlier blocks behind, and a mixed batch.
WINDOW_STEPS = [[(0, 17), (1, 21)], [(1, 1), (0, 13), (2, 9)], [(0, 1), (1, 1), (2, 1)], [(2, 1), (0, 1), (1, 1)]]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_pure_prefill_of_several_requests(num_kv_heads: int) -> None:
    # 8 fills two blocks exactly; 5 and 13 end mid-block.
    seqs = make_sequences([5, 8, 13], num_heads=4, num_kv_heads=num_kv_heads)
    run_step(seqs, [(0, 5), (1, 8), (2, 13)], garbage_cache(num_kv_heads))


def test_decode_batch_crossing_block_boundaries() -> None:
    # Prompts of 3, 4 and 7 tokens, then 3 decodes: each request enters a new
    # block at some step (position 4 or 8).
    seqs = make_sequences([6, 7, 10], num_heads=4, num_kv_heads=2)
    cache = garbage_cache(2)
    run_step(seqs, [(0, 3), (1, 4), (2, 7)], cache)
    for _ in range(3):
        run_step(seqs, [(0, 1), (1, 1), (2, 1)], cache)


def test_chunked_prefill_attends_to_cached_chunks() -> None:
    # Chunks of 3, 6, 4: boundaries fall mid-block, a chunk spans two blocks.
    seqs = make_sequences([13], num_heads=4, num_kv_heads=2)
    cache = garbage_cache(2)
    for chunk in (3, 6, 4):
        run_step(seqs, [(0, chunk)], cache)


def test_mixed_decode_and_prefill_batch() -> None:
    seqs = make_sequences([8, 11, 4, 5, 1], num_heads=4, num_kv_heads=2)
    cache = garbage_cache(2)
    run_step(seqs, [(0, 6), (1, 5)], cache)  # a prompt and the first chunk of another
    run_step(seqs, [(0, 1), (1, 6), (2, 3)], cache)  # decode + last chunk + new prompt
    # Decodes, including a 1-token prompt (query_len 1 makes it one), then a prompt.
    run_step(seqs, [(0, 1), (2, 1), (4, 1), (3, 5)], cache)


def test_attention_layer_requires_metadata_and_cache() -> None:
    layer = Attention(num_heads=4, head_dim=HEAD_DIM, scale=1.0, num_kv_heads=2)
    q = torch.randn(3, 4 * HEAD_DIM)
    kv = torch.randn(3, 2 * HEAD_DIM)
    with pytest.raises(ValueError, match="AttentionMetadata"):
        layer(q, kv, kv, None)
    md = make_attn_metadata([0], [3], [[0]], BLOCK_SIZE)
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        layer(q, kv, kv, md)
    with pytest.raises(ValueError, match="num_kv_heads"):
        Attention(num_heads=4, head_dim=HEAD_DIM, scale=1.0, num_kv_heads=3)


def test_bind_kv_cache_in_layer_order() -> None:
    model = nn.Sequential(*(Attention(4, HEAD_DIM, 1.0, 2) for _ in range(3)))
    caches = [garbage_cache(2) for _ in range(3)]
    bind_kv_cache(model, caches)
    assert all(layer.kv_cache is cache for layer, cache in zip(model, caches))
    with pytest.raises(ValueError, match="3 Attention layers but 2"):
        bind_kv_cache(model, caches[:2])


@pytest.mark.parametrize("sliding_window", [1, 5, 8, 64])
def test_sliding_window_reads_only_the_last_keys(sliding_window: int) -> None:
    """Each query reads its last ``sliding_window`` keys (1: itself; 64: all), even
    after the blocks before its window were handed to another request."""
    seqs = make_sequences([33, 24, 12], num_heads=4, num_kv_heads=2)
    cache = garbage_cache(2, num_blocks=NUM_BLOCKS + 1)  # block NUM_BLOCKS: another request's
    for steps in WINDOW_STEPS:
        run_step(seqs, steps, cache, sliding_window)
        forget_skipped_blocks(seqs, sliding_window, foreign_block=NUM_BLOCKS)
