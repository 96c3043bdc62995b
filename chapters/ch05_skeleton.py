"""Chapter 5 -- the engine skeleton and its source map, printed from the live engine.

The seed note draws the layering LLM -> LLMEngine -> EngineCoreClient ->
EngineCore -> Scheduler -> KVCacheManager with file:line for every node. Here the
same map is computed from the objects of a running engine, so it cannot go
stale; then the engine answers a few prompts (the note's two among them).

    python -m chapters.ch05_skeleton [--model DIR] [--no-generate] [--json]
"""

from __future__ import annotations

import json

from rich.table import Table

from chapters._common import (
    SEED_PROMPTS,
    base_parser,
    console,
    construction_table,
    roles_table,
    timed,
)
from nanoengine import LLM, SamplingParams
from nanoengine.request import RequestStatus
from nanoengine.utils.component_tree import build_component_tree

PROMPTS = [*SEED_PROMPTS, "Hello", "What is the capital of France?"]


def states_table() -> Table:
    """The 12 request states in enum order; "finished" is decided by that order."""
    table = Table(title="RequestStatus: is_finished(status) is status > PREEMPTED")
    table.add_column("value", justify="right")
    table.add_column("state")
    table.add_column("finished?")
    table.add_column("user sees")
    for status in RequestStatus:
        reason = RequestStatus.get_finished_reason(status)
        table.add_row(
            str(int(status)),
            status.name,
            "yes" if RequestStatus.is_finished(status) else "no",
            str(reason) if reason is not None else "",
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--no-generate", action="store_true", help="print the tree only (fast)")
    parser.add_argument("--json", action="store_true", help="print the tree as JSON and exit")
    args = parser.parse_args(argv)

    llm, build_seconds = timed(lambda: LLM(model=args.model))
    if args.json:
        print(json.dumps(build_component_tree(llm).to_dict(), indent=2))
        return

    console.rule("print(llm): the layered map, computed from live objects")
    print(llm)
    console.rule("print(llm.llm_engine.engine_core): the subtree below the client")
    print(llm.llm_engine.engine_core)
    console.print(construction_table(llm))
    console.print(roles_table())
    console.print(states_table())
    if args.no_generate:
        return

    console.rule("generate: the engine loop at work")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs, run_seconds = timed(lambda: llm.chat(conversations, params, use_tqdm=False))
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        console.print(f"[bold]{prompt}[/]\n  -> {completion.text.strip()!r} [{completion.finish_reason}]")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    console.print(
        f"LLM(...) took {build_seconds:.2f} s; generate took {run_seconds:.2f} s "
        f"for {generated} tokens ({generated / run_seconds:.1f} tok/s)."
    )


if __name__ == "__main__":
    main()
