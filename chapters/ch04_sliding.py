"""Chapter 4's sliding-window experiment: blocks that leave the window go back to the pool.

Experiment 5 of ``ch04_kv_cache``, on the grader's tiny random Gemma 3
(``chapters/grade_checks/tiny_model.py``): three local layers that read only
the last 16 tokens, one global layer that reads them all, 4-token blocks. So
the KV cache has four groups: one full-attention group, three sliding-window
groups. One request of 40 prompt tokens (in chunks of 16) and 24 output
tokens is stepped through the engine. After each step the walkthrough prints
the request's table in the full-attention group, which grows a block every 4
tokens, and in a sliding-window group, whose blocks before the window have
been given back, the null block (shown ``·``) in their place. A second
request with the same prompt then finds a prefix hit; its sliding-window
hit needs only the blocks of the window before the hit's end.

The code it reads: ``SlidingWindowManager`` and ``remove_skipped_blocks`` in
``nanoengine/core/single_type_kv_cache_manager.py``, and the hybrid
coordinator's ``find_longest_cache_hit``. vLLM 0.32 counterpart: none (a
walkthrough; the code it shows mirrors ``vllm/v1/core/single_type_kv_cache_manager.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rich.table import Table

from chapters._common import console
from chapters.grade_checks.tiny_model import TINY_SLIDING_WINDOW, tiny_gemma3_model_dir
from nanoengine import LLM, SamplingParams
from nanoengine.core.single_type_kv_cache_manager import SlidingWindowManager
from nanoengine.renderers.hf import TokensPrompt

BLOCK_SIZE = 4
PROMPT_TOKENS = 40  # two and a half windows
OUTPUT_TOKENS = 24  # 64 tokens in all: four windows
CHUNK = 16  # the step's token budget: the prompt arrives in three chunks
NULL = "·"  # how a table entry holding the null block is printed


@dataclass
class SlidingStep:
    """The request's tables after one engine step (block ids; 0 is the null block)."""

    num_computed_tokens: int
    full_table: list[int]  # the full-attention group's
    sliding_table: list[int]  # the first sliding-window group's (the others look alike)
    num_free_blocks: int


@dataclass
class SlidingRun:
    """What experiment 5 observed."""

    window: int
    group_kinds: list[str]  # "full" or "sliding", in group order
    steps: list[SlidingStep]
    hit_tokens: int  # the second request's prefix hit
    hit_tables: list[list[int]]  # its hit blocks, per group (0: the null block)
    same_tokens: bool  # the second request's greedy tokens equal the first's
    num_free_blocks_after: int
    num_usable_blocks: int


def shown(table: list[int]) -> str:
    """A table as the walkthrough prints it: block ids, the null block as ``·``."""
    return " ".join(NULL if block_id == 0 else str(block_id) for block_id in table)


def sliding_run() -> SlidingRun:
    """Experiment 5: one request through a local + global model, then a prefix hit."""
    console.print(
        f"5. a sliding window: a tiny random Gemma 3 (3 local layers of {TINY_SLIDING_WINDOW} tokens, "
        f"1 global layer), blocks of {BLOCK_SIZE} tokens"
    )
    llm = LLM(
        tiny_gemma3_model_dir(),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=CHUNK,
        max_model_len=128,
        num_gpu_blocks_override=96,
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.get_engine_core().scheduler
    coordinator = scheduler.kv_cache_manager.coordinator
    managers = coordinator.single_type_managers
    kinds = ["sliding" if isinstance(m, SlidingWindowManager) else "full" for m in managers]
    rng = random.Random(0)  # random weights, so any token ids will do
    prompt = [rng.randrange(3, engine.engine_config.model_config.vocab_size) for _ in range(PROMPT_TOKENS)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    engine.add_request("a", TokensPrompt(prompt_token_ids=prompt), params)
    first_sliding = kinds.index("sliding")
    steps: list[SlidingStep] = []
    first_output: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            first_output = list(output.outputs[0].token_ids)
        request = scheduler.requests.get("a")
        if request is None:  # finished: every block went back in this step
            break
        tables = scheduler.kv_cache_manager.get_block_ids("a")
        steps.append(SlidingStep(request.num_computed_tokens, tables[0], tables[first_sliding],
                                 scheduler.kv_cache_manager.num_free_blocks))
    console.print(steps_table(steps, first_sliding))

    engine.add_request("b", TokensPrompt(prompt_token_ids=prompt), params)
    waiting = scheduler.requests["b"]
    hits, hit_tokens = coordinator.find_longest_cache_hit(waiting.block_hashes, waiting.num_tokens - 1)
    hit_tables = [[block.block_id for block in group] for group in hits]
    second_output: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            second_output = list(output.outputs[0].token_ids)
    console.print(hit_table(hit_tables, hit_tokens, kinds))
    pool = coordinator.block_pool
    return SlidingRun(
        window=TINY_SLIDING_WINDOW,
        group_kinds=kinds,
        steps=steps,
        hit_tokens=hit_tokens,
        hit_tables=hit_tables,
        same_tokens=first_output == second_output,
        num_free_blocks_after=pool.get_num_free_blocks(),
        num_usable_blocks=pool.num_usable_blocks,
    )


def steps_table(steps: list[SlidingStep], first_sliding: int) -> Table:
    """One row per step: the full-attention table grows, the sliding one keeps a window."""
    table = Table(title=f"5. request 'a' after each step (block ids; {NULL} = the null block, a block given back)")
    for column in ("step", "tokens computed", "full attention (group 0)",
                   f"sliding window (group {first_sliding})", "real blocks", "free"):
        table.add_column(column, justify="right" if column in ("step", "tokens computed", "real blocks", "free")
                         else "left")
    for number, step in enumerate(steps, start=1):
        real = sum(block_id != 0 for block_id in step.sliding_table)
        table.add_row(str(number), str(step.num_computed_tokens), shown(step.full_table),
                      shown(step.sliding_table), str(real), str(step.num_free_blocks))
    return table


def hit_table(hit_tables: list[list[int]], hit_tokens: int, kinds: list[str]) -> Table:
    """The second request's prefix hit in each group: the sliding ones need only the window's blocks."""
    table = Table(title=f"5. request 'b', the same prompt: a prefix hit of {hit_tokens} tokens in every group")
    for column in ("group", "kind", "hit blocks", "real blocks"):
        table.add_column(column)
    for group_id, (kind, blocks) in enumerate(zip(kinds, hit_tables, strict=True)):
        table.add_row(str(group_id), kind, shown(blocks), str(sum(block_id != 0 for block_id in blocks)))
    return table

