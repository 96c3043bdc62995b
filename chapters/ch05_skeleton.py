"""Chapter 5 -- the engine skeleton and its source map, printed from the live engine.

Chapter 5 of the study notes draws the layering LLM -> LLMEngine -> EngineCoreClient ->
EngineCore -> Scheduler -> KVCacheManager with file:line for every node, and
walks the 12-state request machine. Here everything is computed from a running
engine, so it cannot go stale:

1. two maps: what ``LLM(...)`` prepares, what ``generate(...)`` runs (timed);
2. the layered tree with live file:line beside vLLM 0.32's (and the notes' 0.30);
3. the three roles and where they live;
4. ``EngineCore.step()`` on real steps: the grammar bitmask is built while the
   forward pass runs (``execute_model(..., non_block=True)``), then
   ``future.result()`` -- with the overlap measured;
5. the 12 states, each reached by a real request, and every transition seen;
6. what changed since the article "Inside vLLM: Anatomy of a High-Throughput LLM
   Inference System" (August 2025), and between vLLM 0.30 and 0.32.

    python -m chapters.ch05_skeleton [--model DIR] [--no-generate] [--json]
"""

from __future__ import annotations

import json
import tempfile
from statistics import mean

from rich.markup import escape
from rich.table import Table

from chapters._common import (
    SEED_PROMPTS,
    base_parser,
    console,
    construction_table,
    note_on_chinese_prompts,
    roles_table,
    timed,
)
from chapters.ch05_source_map import (
    VllmMap,
    drift_table,
    load_vllm_map,
    source_map_table,
    symbols_table,
    tree_json,
)
from chapters.ch05_state_tour import mermaid, paths_table, run_state_tour, transitions_table
from nanoengine import LLM, SamplingParams, StructuredOutputsParams
from nanoengine.instruments.step_timing import StepTimer, StepTiming, time_construction
from nanoengine.request import RequestStatus

PROMPTS = [*SEED_PROMPTS, "Hello", "What is the capital of France?"]
# A schema small enough for a 135M model to fill in a few dozen tokens.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}
_BLOCKED = {
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: "grammar compiling",
    RequestStatus.WAITING_FOR_REMOTE_KVS: "KV connector loading",
    RequestStatus.WAITING_FOR_STREAMING_REQ: "more prompt to arrive",
}


def states_table() -> Table:
    """The 12 request states in enum order; "finished" is decided by that order."""
    table = Table(title="RequestStatus: is_finished(status) is status > PREEMPTED")
    for column in ("value", "state", "finished?", "blocked on", "user sees"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for status in RequestStatus:
        reason = RequestStatus.get_finished_reason(status)
        table.add_row(
            str(int(status)),
            status.name,
            "yes" if RequestStatus.is_finished(status) else "no",
            _BLOCKED.get(status, ""),
            str(reason) if reason is not None else "",
        )
    return table


def step_anatomy(llm: LLM, max_tokens: int) -> list[StepTiming]:
    """Run two plain requests and one JSON-constrained one; time every step."""
    engine = llm.llm_engine
    timer = StepTimer.attach(engine.engine_core.get_engine_core())
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    structured = plain.clone()
    structured.structured_outputs = StructuredOutputsParams(json=ANSWER_SCHEMA)
    for name, text, params in [
        ("plain-0", "Hello", plain),
        ("plain-1", "Write a Python function that reverses a list.", plain),
        ("json", "Name the capital of France as JSON.", structured),
    ]:
        engine.add_rendered_request(
            name, engine.renderer.render_chat([{"role": "user", "content": text}]), params
        )
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id == "json":
                console.print(f"structured output (JSON schema): {escape(output.outputs[0].text)!s}")
    return [timing for timing in timer.timings if timing.num_scheduled_tokens > 0]


def step_table(timings: list[StepTiming]) -> Table:
    """Mean milliseconds per phase; bitmask work hides inside the forward pass."""
    with_mask = [t for t in timings if t.bitmask_s > 1e-4]
    table = Table(title=f"generate(...) runs: EngineCore.step() anatomy over {len(timings)} steps (mean ms)")
    for column in (
        "steps",
        "schedule",
        "forward (thread)",
        "bitmask (engine)",
        "wait result()",
        "sample",
        "update",
        "overlap",
    ):
        table.add_column(column, justify="right")
    for label, rows in (("all steps", timings), ("steps with a grammar", with_mask)):
        if rows:
            fields = ("schedule_s", "forward_s", "bitmask_s", "wait_s", "sample_s", "update_s", "overlap_s")
            table.add_row(
                f"{label} ({len(rows)})",
                *[f"{mean(getattr(t, name) for t in rows) * 1000:.2f}" for name in fields],
            )
    hidden = sum(t.overlap_s for t in timings)
    table.caption = (
        f"=> {hidden * 1000:.1f} ms of engine-thread work ran while the forward pass was in flight "
        "(execute_model(..., non_block=True) returned a future; future.result() came after the bitmask)"
    )
    return table


def what_changed(vllm_map: VllmMap) -> None:
    """Three changes since the Anatomy of vLLM article, then the line drift 0.30 -> 0.32."""
    console.rule("what changed")
    console.print(
        "1. The renderer is its own component (LLMEngine.renderer): prompts and chat templates are\n"
        "   turned into token ids before the input processor validates them.\n"
        "2. The request machine grew from 3 coarse states to the 12 above: three of them are\n"
        "   'blocked waiting' states the scheduler consults every step\n"
        "   (Scheduler._handle_blocked_waiting_request).\n"
        "3. KVCacheManager talks to the block pool through a KVCacheCoordinator, so layers of different\n"
        "   kinds (full attention, sliding window, MLA, Mamba) can share one cache."
    )
    console.print(drift_table(vllm_map))


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__ or "", __name__)
    parser.add_argument("--no-generate", action="store_true", help="print the maps only (fast)")
    parser.add_argument("--json", action="store_true", help="print the tree, with vLLM counterparts, as JSON")
    args = parser.parse_args(argv)

    with time_construction() as steps:
        llm, build_seconds = timed(lambda: LLM(model=args.model))
    vllm_map = load_vllm_map()
    if args.json:
        print(json.dumps(tree_json(llm, vllm_map), indent=2))
        return

    console.rule(f"map 1 -- LLM(...) prepares ({build_seconds:.2f} s)")
    console.print(construction_table(llm, steps))
    console.rule("print(llm): the layered map, computed from live objects")
    print(llm)
    console.rule("print(llm.llm_engine.engine_core): the subtree below the client")
    print(llm.llm_engine.engine_core)
    console.print(source_map_table(llm, vllm_map))
    console.print(roles_table())
    console.print(symbols_table(vllm_map))
    console.print(states_table())
    if args.no_generate:
        what_changed(vllm_map)
        return

    console.rule("map 2 -- generate(...) runs: the engine loop at work")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs, run_seconds = timed(lambda: llm.chat(conversations, params, use_tqdm=False))
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        # escape(): "[length]" would otherwise be read as rich markup and vanish.
        console.print(
            f"[bold]{escape(prompt)}[/]\n  -> {escape(repr(completion.text.strip()))} "
            f"{escape(f'[{completion.finish_reason}]')}"
        )
    note_on_chinese_prompts(args.model)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    console.print(
        f"generate took {run_seconds:.2f} s for {generated} tokens ({generated / run_seconds:.1f} tok/s)."
    )
    console.print(step_table(step_anatomy(llm, args.max_tokens)))
    llm.llm_engine.shutdown()  # the tour builds its own pair of engines

    console.rule("the 12 states, reached by real requests")
    with tempfile.TemporaryDirectory(prefix="nanoengine-kv-") as storage:
        tour = run_state_tour(args.model, storage, max_tokens=args.max_tokens)
    console.print(transitions_table(tour))
    console.print(paths_table(tour))
    missing = sorted(set(RequestStatus) - tour.states_reached())
    console.print(
        f"states reached: {len(tour.states_reached())}/12"
        + (f" (missing: {', '.join(s.name for s in missing)})" if missing else "")
        + f"; remote-kv skipped {tour.skipped_prefill_tokens} prompt tokens of prefill; {tour.seconds:.1f} s"
    )
    console.print("mermaid (paste into any mermaid viewer):")
    print(mermaid(tour))
    what_changed(vllm_map)


if __name__ == "__main__":
    main()
