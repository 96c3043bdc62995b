"""The step trace as a rich table: one row per engine step.

Chapters 3 (scheduler) and 4 (KV cache manager). Columns, left to right, follow
one step: how many tokens were scheduled and for whom (``r3:P0-63`` = request 3,
prefill of positions 0..63; ``r1:D`` = one decode token; ``r2:R`` = recompute
after preemption), which blocks were handed out, prefix-cache hits, who was
preempted and why, what was freed or evicted, and the state left behind (KV
usage, queue lengths) with the wall time of schedule / execute / update.

With speculative decoding (chapter 9) a decode that verifies ``k`` drafts
reads ``r1:D+3``, and three more columns follow ``scheduled``: the drafts
each request verified, how many the target model accepted, and how many it
rejected (``r1:3``, ``r1:2``, ``r1:1``). They appear only in a trace where
some step had drafts, so a run without speculation prints the same table as before.

``live_table(trace)`` keeps the table on screen while ``generate`` runs.

vLLM 0.32 counterpart: none (vLLM logs aggregate throughput and KV usage lines
from ``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.live import Live
from rich.table import Table

from nanoengine.instruments.trace.data import EngineTrace, ScheduledChunk, StepTrace

_KIND_LETTER = {"prefill": "P", "decode": "D", "recompute": "R"}


def request_label(request_id: str) -> str:
    """``r3`` for the numeric ids ``LLM.generate`` assigns, the id itself otherwise."""
    return f"r{request_id}" if request_id.isdigit() else request_id


def format_chunk(chunk: ScheduledChunk) -> str:
    """``r<id>:D`` for a decode (``r<id>:D+<k>`` with k drafts), else ``r<id>:<P|R><first>-<last>``."""
    label = request_label(chunk.request_id)
    if chunk.kind == "decode":
        return f"{label}:D+{chunk.num_draft_tokens}" if chunk.num_draft_tokens else f"{label}:D"
    return f"{label}:{_KIND_LETTER.get(chunk.kind, '?')}{chunk.start}-{chunk.start + chunk.num_tokens - 1}"


def _blocks(chunks: list[ScheduledChunk]) -> str:
    return " ".join(f"{request_label(c.request_id)}+{c.new_block_ids}" for c in chunks if c.new_block_ids)


def _per_request(chunks: list[ScheduledChunk], count: Callable[[ScheduledChunk], int]) -> str:
    """``r1:3 r2:0``: one count per request that had drafts this step (zeros included)."""
    return " ".join(f"{request_label(c.request_id)}:{count(c)}" for c in chunks if c.num_draft_tokens)


def draft_cells(step: StepTrace) -> list[str]:
    """The three draft columns of one step: drafts verified, accepted, rejected (chapter 9)."""
    return [
        _per_request(step.scheduled, lambda c: c.num_draft_tokens),
        _per_request(step.scheduled, lambda c: c.num_accepted_tokens),
        _per_request(step.scheduled, lambda c: c.num_rejected_tokens),
    ]


def step_row(step: StepTrace, with_drafts: bool = False) -> list[str]:
    """The cells of one step, in ``trace_table``'s column order (``with_drafts``: its draft columns too)."""
    hits = " ".join(
        f"{request_label(c.request_id)}:{c.num_cached_tokens}" for c in step.scheduled if c.num_cached_tokens
    )
    preempted = " ".join(
        f"{request_label(p.victim_id)} ({p.reason}, for {request_label(p.for_request_id)})"
        for p in step.preemptions
    )
    freed = " ".join(f"{request_label(rid)}-{ids}" for rid, ids in step.freed_block_ids.items())
    if step.evicted_block_ids:
        freed = f"{freed} evict{step.evicted_block_ids}".strip()
    finished = " ".join(request_label(rid) for rid in step.finished)
    return [
        str(step.step),
        str(step.num_scheduled_tokens),
        " ".join(format_chunk(chunk) for chunk in step.scheduled),
        # Right after ``scheduled``, so each count reads beside the ``D+k`` it belongs to.
        *(draft_cells(step) if with_drafts else []),
        _blocks(step.scheduled),
        hits,
        preempted,
        freed,
        finished,
        f"{step.kv_usage:.0%}",
        f"{step.num_running}/{step.num_waiting}",
        f"{step.schedule_s * 1e3:.2f}/{step.execute_s * 1e3:.1f}/{step.update_s * 1e3:.2f}",
    ]


def trace_table(trace: EngineTrace, last: int | None = None, title: str | None = None) -> Table:
    """All steps of ``trace`` (or the ``last`` ones) as a rich Table."""
    # Decided on the whole trace, not the rows shown, so that a live table
    # keeps its columns once the first drafts have scrolled away.
    with_drafts = trace.has_drafts
    caption = "P=prefill  D=decode  R=recompute after preemption; positions are token indices"
    if with_drafts:
        caption += "\nD+k = decode verifying k draft tokens; accepted ones are kept, rejected ones rolled back"
    table = Table(
        title=title or f"Engine steps (block_size={trace.block_size}, num_blocks={trace.num_blocks})",
        caption=caption,
    )
    drafts = (("drafts", "left"), ("accepted", "left"), ("rejected", "left")) if with_drafts else ()
    for header, justify in (
        ("step", "right"),
        ("tokens", "right"),
        ("scheduled", "left"),
        *drafts,
        ("new blocks", "left"),
        ("cache hit", "left"),
        ("preempted", "left"),
        ("freed / evicted", "left"),
        ("finished", "left"),
        ("KV", "right"),
        ("run/wait", "right"),
        ("ms sched/exec/upd", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    steps = trace.steps if last is None else trace.steps[-last:]
    for step in steps:
        table.add_row(*step_row(step, with_drafts))
    return table


@contextmanager
def live_table(trace: EngineTrace, console: Console | None = None, last: int = 20) -> Iterator[None]:
    """Redraw the last ``last`` steps of ``trace`` after every step while the block runs.

    Off a terminal (CI logs, pipes) rich prints the final table once instead.
    """
    with Live(trace_table(trace, last=last), console=console, auto_refresh=False) as live:

        def redraw(_: StepTrace) -> None:
            live.update(trace_table(trace, last=last), refresh=True)

        trace.listeners.append(redraw)
        try:
            yield
        finally:
            trace.listeners.remove(redraw)
