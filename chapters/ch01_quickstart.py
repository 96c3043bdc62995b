"""Chapter 1 -- quickstart and the three roles.

Runs the study notes' snippet on the live engine, then shows the chapter's two
maps: what ``LLM(...)`` prepares (weights, a profiling pass, the KV cache) and
what ``generate(...)`` runs (the step loop), and where the three roles live.

    python -m chapters.ch01_quickstart [--model DIR] [--max-tokens N]
"""

from __future__ import annotations

from chapters._common import (
    SEED_PROMPTS,
    base_parser,
    console,
    construction_table,
    note_on_chinese_prompts,
    roles_table,
    timed,
)
from nanoengine import LLM, SamplingParams
from nanoengine.instruments.step_timing import time_construction


def main(argv: list[str] | None = None) -> None:
    args = base_parser(__doc__ or "", __name__).parse_args(argv)

    # The study notes' code, with only the import changed.
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0)
    with time_construction() as steps:
        llm, build_seconds = timed(lambda: LLM(model=args.model))
    outputs, run_seconds = timed(lambda: llm.generate(SEED_PROMPTS, sampling_params, use_tqdm=False))

    console.rule("generate(...) output")
    for output in outputs:
        completion = output.outputs[0]
        console.print(f"[bold]{output.prompt!r}[/] -> {completion.text!r} ({completion.finish_reason})")
    note_on_chinese_prompts(args.model)

    console.rule("Two lines, two jobs")
    console.print(f"LLM(...)      took {build_seconds:6.2f} s: it decides how many requests can run at once.")
    console.print(f"generate(...) took {run_seconds:6.2f} s: it decides how long each request takes.")
    console.print(construction_table(llm, steps))
    console.print(roles_table())


if __name__ == "__main__":
    main()
