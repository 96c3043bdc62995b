"""Chapter 3 -- the scheduler, one step at a time, on the live engine.

Three experiments, each read off the step tracer (``LLM(..., trace=True)``):

1. the token budget: a long prompt gets at most ``max_num_batched_tokens``
   tokens per step, so its prefill is cut into chunks;
2. decode and prefill share a step: a short request decodes while the long
   one's chunks go on, in the same forward pass;
3. the priority policy: a high-priority request arriving while the KV cache is
   full preempts a running low-priority one, which later resumes.

    python -m chapters.ch03_scheduler [--model DIR] [--max-num-batched-tokens N]
                                      [--block-size N] [--num-blocks N]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from chapters._common import base_parser, console
from nanoengine import LLM, SamplingParams
from nanoengine.instruments.trace import trace_table
from nanoengine.renderers.hf import TokensPrompt

LONG_TEXT = (
    "The scheduler hands out a token budget every step. Running requests are served first, "
    "then waiting ones, and a prompt that does not fit is cut into chunks. "
)


@dataclass
class Ch03Result:
    """What the walkthrough observed (tests assert on it)."""

    long_prompt_len: int
    chunk_sizes: list[int]  # tokens of the long prompt's prefill, step by step
    mixed_steps: int  # steps that ran a decode and a prefill chunk together
    priority_preemptions: list[tuple[str, str]]  # (victim, for_request) under the priority policy
    finish_order: list[str]  # order the priority demo's requests finished in


def token_ids(llm: LLM, text: str, length: int) -> list[int]:
    """``length`` token ids of ``text`` repeated: exact lengths with any tokenizer."""
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


def budget_and_mixing(args: argparse.Namespace) -> tuple[int, list[int], int]:
    """Experiments 1 and 2: one long prompt and one short one under a small budget."""
    budget = args.max_num_batched_tokens
    llm = LLM(args.model, trace=True, max_num_batched_tokens=budget, block_size=args.block_size)
    long_prompt = token_ids(llm, LONG_TEXT, 3 * budget + budget // 2)
    short_prompt = token_ids(llm, "Hello there.", 8)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # The short request is first in line: its whole prompt fits step 0, then it
    # decodes (1 token a step) while the long prompt's chunks take the rest.
    llm.generate(
        [TokensPrompt(prompt_token_ids=short_prompt), TokensPrompt(prompt_token_ids=long_prompt)],
        params,
        use_tqdm=False,
    )
    trace = llm.trace
    assert trace is not None
    console.print(trace_table(trace, title=f"1+2. budget {budget} tokens/step: chunked prefill, mixed steps"))
    chunk_sizes = [c.num_tokens for _, c in trace.chunks_of("1") if c.kind == "prefill"]
    mixed = sum(1 for step in trace.steps if {c.kind for c in step.scheduled} >= {"decode", "prefill"})
    console.print(
        f"The {len(long_prompt)}-token prompt ran as chunks {chunk_sizes}; "
        f"{mixed} steps mixed a decode with a prefill chunk.\n"
    )
    return len(long_prompt), chunk_sizes, mixed


def priority_preemption(args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[str]]:
    """Experiment 3: a cache with room for one request; an urgent one arrives mid-run."""
    block_size = args.block_size
    # 6 usable blocks: "low" needs 4 to start and grows; "urgent" needs 3 more.
    llm = LLM(
        args.model,
        trace=True,
        scheduling_policy="priority",
        block_size=block_size,
        num_gpu_blocks_override=args.num_blocks or 7,
        max_model_len=6 * block_size,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=block_size, ignore_eos=True)
    low = TokensPrompt(prompt_token_ids=token_ids(llm, LONG_TEXT, 4 * block_size - 2))
    urgent = TokensPrompt(prompt_token_ids=token_ids(llm, "Urgent: answer me first!", 2 * block_size + 1))
    # Lower value = more urgent (vLLM's convention); ties go by arrival time.
    engine.add_request("low", low, params, priority=10)
    finish_order: list[str] = []
    step = 0
    while engine.has_unfinished_requests():
        if step == 3:  # "low" is decoding and holds most of the cache
            engine.add_request("urgent", urgent, params, priority=0)
        finish_order += [out.request_id for out in engine.step() if out.finished]
        step += 1
    trace = llm.trace
    assert trace is not None
    console.print(trace_table(trace, title="3. priority policy: the urgent request preempts the running one"))
    preemptions = [(p.victim_id, p.for_request_id) for s in trace.steps for p in s.preemptions]
    console.print(f"preemptions (victim, for): {preemptions}; finish order: {finish_order}\n")
    return preemptions, finish_order


def main(argv: list[str] | None = None) -> Ch03Result:
    parser = base_parser(__doc__ or "", __name__)
    parser.set_defaults(max_tokens=6)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64, help="the per-step token budget")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks of the priority demo (default 7)"
    )
    args = parser.parse_args(argv)
    long_len, chunk_sizes, mixed = budget_and_mixing(args)
    preemptions, finish_order = priority_preemption(args)
    return Ch03Result(long_len, chunk_sizes, mixed, preemptions, finish_order)


if __name__ == "__main__":
    main()
