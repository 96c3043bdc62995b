"""Which steps may replay a CUDA graph, and how a batch is padded to fit one.

Chapter 7 (``generate(...)``): a decode step of a small model on a GPU is a few
hundred tiny kernel launches, and launching them from Python costs more than
running them. A CUDA graph records the launches of one decode step once, for a
fixed batch size, and replays them with one call. Shapes are frozen at capture,
so the model runner captures a ladder of batch sizes and pads each real batch
up to the next captured size; the padding rows are harmless (slot -1: nothing
written; seq_len 0: output zero) and their logits are never read.

This module holds the decisions and the padding, with no CUDA in it, so both
are unit-tested and shown (chapter 7's walkthrough) on a CPU; the recording and
replay live in ``worker/cudagraph_runner.py``.
vLLM 0.32 counterpart: ``vllm/v1/cudagraph_dispatcher.py`` (``CudagraphDispatcher``)
and the padding in ``GPUModelRunner._prepare_inputs`` /
``vllm/config/compilation.py`` (``cudagraph_capture_sizes``).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, replace

import torch

from nanoengine.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs``.

    Fine steps at the small end (where padding a batch of 3 to 8 would waste
    most of the step), coarse ones where 8 rows more cost little.
    """
    ladder = [1, 2, 4, *range(8, max(max_num_seqs, 8) + 1, 8)]
    sizes = sorted({min(size, max_num_seqs) for size in ladder})
    return sizes


@dataclass(frozen=True)
class CudagraphDecision:
    """What the runner does with one step, and why (printed by chapter 7)."""

    use_graph: bool
    padded_batch_size: int  # == the real batch size when eager
    reason: str


class CudagraphDispatcher:
    """Decides, per step, between replaying a captured graph and running eagerly."""

    def __init__(self, capture_sizes: list[int], max_blocks_per_req: int, enabled: bool = True) -> None:
        if any(size < 1 for size in capture_sizes):
            raise ValueError(f"cudagraph capture sizes must be positive, got {capture_sizes}.")
        self.capture_sizes = sorted(set(capture_sizes))
        # Every graph is captured with a block table this wide; a request
        # needing more columns cannot be copied into the static buffer.
        self.max_blocks_per_req = max_blocks_per_req
        self.enabled = enabled and bool(self.capture_sizes)
        self._warned: set[str] = set()

    def dispatch(self, num_reqs: int, num_tokens: int, block_table_width: int) -> CudagraphDecision:
        """Graph only for pure decode batches that fit a captured shape."""
        if not self.enabled:
            return CudagraphDecision(
                False,
                num_tokens,
                "CUDA graphs are off (enforce_eager, no CUDA, a hybrid model, tensor parallelism or speculation)",
            )
        if num_tokens != num_reqs:
            return CudagraphDecision(False, num_tokens, "the step has a prefill: shapes vary, run eager")
        largest = self.capture_sizes[-1]
        if num_reqs > largest:
            return self._fallback(
                num_tokens, "batch", f"{num_reqs} decodes > largest captured size {largest}"
            )
        if block_table_width > self.max_blocks_per_req:
            return self._fallback(
                num_tokens,
                "width",
                f"block table width {block_table_width} > captured width {self.max_blocks_per_req}",
            )
        padded = self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_reqs)]
        return CudagraphDecision(True, padded, f"{num_reqs} decodes padded to the graph of {padded}")

    def _fallback(self, num_tokens: int, kind: str, why: str) -> CudagraphDecision:
        # Once per kind: a long run of oversized batches should not flood the log.
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("CUDA graph fallback to eager: %s (warned once).", why)
        return CudagraphDecision(False, num_tokens, f"eager fallback: {why}")


def pad_decode_inputs(inputs: StepInputs, padded_size: int, block_table_width: int) -> StepInputs:
    """The same decode step, ``padded_size`` rows long, in graph-ready form.

    Real row i keeps its token, position, slot and block-table row; each padding
    row is a request of its own with slot -1 and seq_len 0, so attention writes
    nothing for it and returns zero. ``token_to_req`` is filled in, so no kernel
    needs the Python lists. Shapes: every per-token tensor [padded_size],
    ``block_table`` [padded_size, block_table_width], ``query_start_loc``
    [padded_size + 1].
    """
    md = inputs.attn_metadata
    num_reqs = md.num_reqs
    if md.num_actual_tokens != num_reqs or padded_size < num_reqs:
        raise ValueError(
            f"pad_decode_inputs needs a pure decode batch no larger than padded_size={padded_size}; "
            f"got {md.num_actual_tokens} tokens for {num_reqs} requests."
        )
    device = inputs.input_ids.device
    num_pad = padded_size - num_reqs

    def pad(tensor: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_full((num_pad,), value)])

    block_table = md.block_table.new_zeros((padded_size, block_table_width))
    block_table[:num_reqs, : md.block_table.shape[1]] = md.block_table
    rows = torch.arange(padded_size + 1, dtype=torch.int32, device=device)
    padded_md = replace(
        md,
        num_decodes=padded_size,
        query_start_loc=rows,
        seq_lens=pad(md.seq_lens, 0),
        block_table=block_table,
        slot_mapping=pad(md.slot_mapping, -1),
        token_to_req=rows[:-1],
    )
    return replace(
        inputs,
        input_ids=pad(inputs.input_ids, 0),
        positions=pad(inputs.positions, 0),
        attn_metadata=padded_md,
    )
