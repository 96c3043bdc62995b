"""Chapter 4 -- the KV cache manager: paged blocks, prefix caching, eviction, preemption, hybrid groups.

Five experiments on live engines, read off the step tracer and the pool:

1. a shared system prompt: two requests' block tables point at the same
   blocks (``ref_cnt`` 2), and later requests hit the prefix cache;
2. a KV cache too small for the batch: ``allocate_slots`` returns None, the
   scheduler preempts, and the victim is re-prefilled later -- mostly from the
   prefix cache, because freeing a block does not erase it (timeline picture);
3. LRU eviction: freed blocks queue up tail-first, so a request's suffix is
   evicted before its prefix, and a rerun still hits the prefix;
4. a hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention): the
   page-size arithmetic that lets its KV cache groups share one pool, then one
   request step by step -- its attention table grows with the sequence, each
   state group keeps one block, and every block comes back at the end
   (``chapters/ch04_groups.py``, which also prints every group's block table);
5. a sliding window (a tiny random Gemma 3: local layers of 16 tokens, one
   global layer): the local layers' blocks before the window go back to the
   pool as the request grows, the null block in their place, and a prefix hit
   on them needs only the window's blocks (``chapters/ch04_sliding.py``).

    python -m chapters.ch04_kv_cache [--model DIR] [--block-size N] [--num-blocks N]
                                     [--max-num-batched-tokens N] [--timeline PATH]
                                     [--hybrid-model NAME_OR_DIR | none]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from chapters._common import base_parser, console
from chapters.ch03_scheduler import token_ids
from chapters.ch04_groups import HYBRID_MODEL, HybridRun, block_table, hybrid_run
from chapters.ch04_sliding import SlidingRun, sliding_run
from nanoengine import LLM, SamplingParams
from nanoengine.instruments.trace import save_timeline, trace_table
from nanoengine.renderers.hf import TokensPrompt

SYSTEM_TEXT = "You are a helpful assistant. Answer briefly and precisely. "
QUESTIONS = ["What is paging?", "Why share blocks?", "Who evicts what?", "When to preempt?"]


@dataclass
class Ch04Result:
    """What the walkthrough observed (tests assert on it)."""

    shared_block_ids: list[int]  # blocks both first requests' tables hold
    prefix_hit_rate: float  # experiment 1, hit tokens / looked-up tokens
    num_preemptions: int  # experiment 2
    resume_hit_tokens: int  # experiment 2: tokens re-prefilled for free by the prefix cache
    recomputed_tokens: int  # experiment 2: tokens that did have to run again
    free_queue_head: list[int]  # experiment 3: cached free blocks, next-to-evict first
    evicted_block_ids: list[int]  # experiment 3: what the unrelated request evicted
    rerun_hit_tokens: int  # experiment 3: the first request's rerun still hits its prefix
    timeline_paths: list[str]
    hybrid: HybridRun | None  # experiment 4 (None: skipped with --hybrid-model none)
    sliding: SlidingRun  # experiment 5


def shared_system_prompt(args: argparse.Namespace, bs: int) -> tuple[list[int], float]:
    """Experiment 1: four requests behind one 3-block system prompt."""
    llm = LLM(args.model, trace=True, block_size=bs, max_num_batched_tokens=args.max_num_batched_tokens)
    system = token_ids(llm, SYSTEM_TEXT, 3 * bs)
    prompts = [TokensPrompt(prompt_token_ids=system + token_ids(llm, q, bs // 2 + 3)) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = llm.llm_engine
    scheduler = engine.engine_core.get_engine_core().scheduler
    # Two arrive together and run one step: the second already shares the
    # first one's full blocks (registered before the forward pass, see allocate_slots).
    engine.add_request("a", prompts[0], params)
    engine.step()
    engine.add_request("b", prompts[1], params)
    engine.step()
    console.print(block_table(scheduler, "a"), block_table(scheduler, "b"))
    (a_blocks,), (b_blocks,) = (scheduler.kv_cache_manager.get_block_ids(rid) for rid in ("a", "b"))
    shared = sorted(set(a_blocks) & set(b_blocks))
    llm.generate(prompts[2:], params, use_tqdm=False)  # steps a and b to the end too
    trace = llm.trace
    assert trace is not None
    hits = {
        c.request_id: c.num_cached_tokens for s in trace.steps for c in s.scheduled if c.num_cached_tokens
    }
    console.print(
        f"shared blocks {shared}; cache hits per request (tokens): {hits}; "
        f"prefix cache hit rate {trace.prefix_cache_hit_rate:.0%}\n"
    )
    return shared, trace.prefix_cache_hit_rate


def preemption(args: argparse.Namespace, bs: int) -> tuple[LLM, int, int, int, list[str]]:
    """Experiment 2: four requests that need ~18 blocks share a cache of ``num_blocks - 1``."""
    num_blocks = args.num_blocks or 10
    llm = LLM(
        args.model,
        trace=True,
        block_size=bs,
        num_gpu_blocks_override=num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=(num_blocks - 1) * bs,
    )
    prompts = [TokensPrompt(prompt_token_ids=token_ids(llm, q, 2 * bs + bs // 2)) for q in QUESTIONS]
    llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False
    )
    trace = llm.trace
    assert trace is not None
    console.print(trace_table(trace, title=f"2. {num_blocks} blocks of {bs} tokens: preemption and recompute"))
    # A resumed request is re-admitted as new: its prefix-cache hit is what it did not recompute.
    resumed = [
        c
        for s in trace.steps
        for c in s.scheduled
        if c.kind == "recompute" or (c.num_cached_tokens and c.start >= c.num_prompt_tokens)
    ]
    hit = sum(c.num_cached_tokens for c in resumed)
    recomputed = sum(c.num_tokens for s in trace.steps for c in s.scheduled if c.kind == "recompute")
    console.print(
        f"{trace.num_preemptions} preemptions; on resume the prefix cache supplied {hit} tokens, "
        f"{recomputed} were recomputed.\n"
    )
    paths = [str(p) for p in save_timeline(trace, args.timeline)] if args.timeline else []
    if paths:
        console.print(f"timeline written to {paths}\n")
    return llm, trace.num_preemptions, hit, recomputed, paths


def lru_eviction(llm: LLM, bs: int) -> tuple[list[int], list[int], int]:
    """Experiment 3, on the idle engine of experiment 2: who gets evicted first."""
    scheduler, trace = llm.llm_engine.engine_core.get_engine_core().scheduler, llm.trace
    assert trace is not None and scheduler.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    first = TokensPrompt(prompt_token_ids=token_ids(llm, SYSTEM_TEXT, 3 * bs + 4))  # 3 full blocks + 4 tokens
    llm.generate([first], params, use_tqdm=False)
    pool = scheduler.kv_cache_manager.block_pool
    queue = pool.free_block_queue.get_all_free_blocks()
    cached_head = [b.block_id for b in queue if b.block_hash is not None]
    console.print(
        f"free queue, head first ({len(queue)} blocks; * = still cached): "
        + " ".join(f"{b.block_id}{'*' if b.block_hash else ''}" for b in queue)
    )
    # An unrelated request that needs every uncached free block plus one more.
    num_uncached = len(queue) - len(cached_head)
    trace.clear()
    llm.generate(
        [TokensPrompt(prompt_token_ids=token_ids(llm, "Unrelated text. ", (num_uncached + 1) * bs - 1))],
        params,
        use_tqdm=False,
    )
    evicted = [block_id for step in trace.steps for block_id in step.evicted_block_ids]
    trace.clear()
    llm.generate([first], params, use_tqdm=False)
    rerun_hit = trace.steps[0].scheduled[0].num_cached_tokens
    console.print(
        f"the unrelated request evicted {evicted} (the first request's *last* full block); "
        f"rerunning the first request still hits {rerun_hit} tokens of its prefix.\n"
    )
    return cached_head, evicted, rerun_hit


def main(argv: list[str] | None = None) -> Ch04Result:
    parser = base_parser(__doc__ or "", __name__)
    parser.set_defaults(max_tokens=32)  # experiment 2: long enough to outgrow the cache
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV cache block (a hybrid model may raise it)"
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks of experiments 2-3 (default 10)"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=128, help="the per-step token budget")
    parser.add_argument(
        "--timeline", default=None, help="write experiment 2's timeline to PATH (.png and .svg)"
    )
    parser.add_argument(
        "--hybrid-model",
        default=HYBRID_MODEL,
        help="experiment 4's hybrid model, run with random weights (default %(default)s; 'none' skips it)",
    )
    args: argparse.Namespace = parser.parse_args(argv)
    bs = args.block_size
    shared, hit_rate = shared_system_prompt(args, bs)
    llm, num_preemptions, resume_hits, recomputed, paths = preemption(args, bs)
    cached_head, evicted, rerun_hit = lru_eviction(llm, bs)
    skip_hybrid = args.hybrid_model.lower() == "none"
    hybrid = None if skip_hybrid else hybrid_run(args.hybrid_model, bs, args.max_num_batched_tokens)
    return Ch04Result(
        shared,
        hit_rate,
        num_preemptions,
        resume_hits,
        recomputed,
        cached_head,
        evicted,
        rerun_hit,
        paths,
        hybrid,
        sliding_run(),
    )


if __name__ == "__main__":
    main()
