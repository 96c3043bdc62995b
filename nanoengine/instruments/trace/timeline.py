"""The step trace as a picture: one row per request over engine steps, KV usage beneath.

Chapters 3 (scheduler) and 4 (KV cache manager). Each request is a horizontal
bar: grey while waiting, blue for prefill chunks, orange for recompute after a
preemption, green for decode steps, a red cell where it was preempted, and a
black tick where it finished. The lower panel is the fraction of KV blocks in
use after each step's scheduling -- preemptions sit where it touches 100%.

Needs matplotlib (``pip install nanoengine[plot]``); the data and the table
do not.

vLLM 0.32 counterpart: none.
"""

from __future__ import annotations

from pathlib import Path

from nanoengine.instruments.trace.data import TIMELINE_STATES, EngineTrace

_COLORS = {
    "waiting": "#c7c7c7",
    "prefill": "#1f77b4",
    "recompute": "#ff7f0e",
    "decode": "#2ca02c",
    "stalled": "#e6e6a0",
    "preempted": "#d62728",
}


def save_timeline(trace: EngineTrace, path: str | Path, title: str | None = None) -> list[Path]:
    """Draw ``trace`` and save it as ``<path>.png`` and ``<path>.svg``; return both paths."""
    try:
        import matplotlib
    except ImportError as error:  # the plot extra is optional
        raise ImportError("The timeline needs matplotlib: pip install 'nanoengine[plot]'.") from error
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timelines = trace.request_timelines()
    if not timelines:
        raise ValueError("The trace has no requests to draw (was tracing on while generating?).")
    num_steps = len(trace.steps)
    height = 1.2 + 0.32 * len(timelines) + 1.4
    figure, (rows, usage) = plt.subplots(
        2, 1, sharex=True, figsize=(10, height), gridspec_kw={"height_ratios": [max(len(timelines), 2), 2]}
    )
    for row, timeline in enumerate(timelines):
        for state in TIMELINE_STATES:
            spans = [(s.start_step, s.num_steps) for s in timeline.segments if s.state == state]
            if spans:
                rows.broken_barh(spans, (row - 0.4, 0.8), facecolors=_COLORS[state])
        if timeline.finished_step is not None:
            rows.plot([timeline.finished_step + 1] * 2, [row - 0.45, row + 0.45], color="black", linewidth=2)
    rows.set_yticks(range(len(timelines)), [f"req {t.request_id}" for t in timelines])
    rows.invert_yaxis()  # first arrival on top
    rows.set_xlim(0, num_steps)
    rows.legend(
        handles=[Patch(color=_COLORS[state], label=state) for state in TIMELINE_STATES]
        + [Patch(color="black", label="finished")],
        loc="upper center",
        bbox_to_anchor=(0.5, 1.0 + 1.2 / max(len(timelines), 2)),
        ncol=len(TIMELINE_STATES) + 1,
        fontsize="small",
        frameon=False,
    )
    # Step i spans [i, i + 1) on the x axis, like its cells in the rows above.
    usage_percent = [100 * step.kv_usage for step in trace.steps]
    usage.stairs(usage_percent, range(num_steps + 1), fill=True, color="#9467bd", alpha=0.5)
    usage.set_ylim(0, 105)
    usage.set_ylabel("KV used %")
    usage.set_xlabel("engine step")
    figure.suptitle(
        title or f"{len(timelines)} requests, {num_steps} steps, {trace.num_preemptions} preemptions"
    )
    figure.tight_layout()
    base = Path(path).with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix in (".png", ".svg"):
        target = base.with_suffix(suffix)
        figure.savefig(target, dpi=120)
        written.append(target)
    plt.close(figure)
    return written
