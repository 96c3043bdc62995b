"""The step trace as a rich table: one row per engine step.

Chapters 3 (scheduler) and 4 (KV cache manager). Columns, left to right, follow
one step: how many tokens were scheduled and for whom (``r3:P0-63`` = request 3,
prefill of positions 0..63; ``r1:D`` = one decode token; ``r2:R`` = recompute
after preemption), which blocks were handed out, prefix-cache hits, who was
preempted and why, what was freed or evicted, and the state left behind (KV
usage, queue lengths) with the wall time of schedule / execute / update.

``live_table(trace)`` keeps the table on screen while ``generate`` runs.

vLLM 0.32 counterpart: none (vLLM logs aggregate throughput and KV usage lines
from ``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
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
    """``r<id>:D`` for a decode, else ``r<id>:<P|R><first>-<last>`` (token positions)."""
    label = request_label(chunk.request_id)
    if chunk.kind == "decode":
        return f"{label}:D"
    return f"{label}:{_KIND_LETTER.get(chunk.kind, '?')}{chunk.start}-{chunk.start + chunk.num_tokens - 1}"


def _blocks(chunks: list[ScheduledChunk]) -> str:
    return " ".join(f"{request_label(c.request_id)}+{c.new_block_ids}" for c in chunks if c.new_block_ids)


def step_row(step: StepTrace) -> list[str]:
    """The cells of one step, in ``trace_table``'s column order."""
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
    table = Table(
        title=title or f"Engine steps (block_size={trace.block_size}, num_blocks={trace.num_blocks})",
        caption="P=prefill  D=decode  R=recompute after preemption; positions are token indices",
    )
    for header, justify in (
        ("step", "right"),
        ("tokens", "right"),
        ("scheduled", "left"),
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
        table.add_row(*step_row(step))
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
