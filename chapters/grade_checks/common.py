"""What every exercise's checks share: the ``Check`` record, request and spec
builders, and the short greedy generations the end-to-end checks compare.

Chapters 1, 3-10. vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from nanoengine import LLM, SamplingParams
from nanoengine.core.kv_cache_manager import KVCacheBlocks
from nanoengine.kv_cache_interface import FullAttentionSpec
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.request import Request

# How long the student's code may run in one check before the grader calls it
# a hang and ends the grade (chapters/grade.py). A unit check calls the
# student's function on small inputs: well under a second. An end-to-end check
# (its name says so) builds a small engine and generates: at most 14 s on a
# 2-core Xeon, about four times that on the slowest laptop CPU measured.
UNIT_CHECK_DEADLINE_S = 30.0
END_TO_END_DEADLINE_S = 90.0
# The student's code gets this long for all of an exercise's unit checks
# together, and each end-to-end check's deadline on top: one budget for the
# whole grade, stated when it starts (``grade_budget_s``).
UNIT_CHECKS_BUDGET_S = 30.0


@dataclass(frozen=True)
class Check:
    """One named comparison: ``run(model_dir)`` must give the reference's result."""

    name: str
    run: Callable[[str], Any]
    # The model an end-to-end check builds when it is not the one the grader is
    # given (``--model``): a tiny model written by the grader itself.
    own_model: str | None = None

    @property
    def is_end_to_end(self) -> bool:
        """An end-to-end check builds an engine; the others call the student's function alone."""
        return self.name.startswith("end to end")

    def runs_on(self, model: str, unit_check: str = "no model (unit check)") -> str:
        """What the check runs on, in words, for the grader's header and ``--list``
        (``unit_check``: the words for no model, in the grader's language)."""
        if not self.is_end_to_end:
            return unit_check
        return self.own_model or model

    @property
    def deadline_s(self) -> float:
        """Seconds the check may take before it fails as "did not return"."""
        return END_TO_END_DEADLINE_S if self.is_end_to_end else UNIT_CHECK_DEADLINE_S


def grade_budget_s(checks: Sequence[Check]) -> float:
    """Seconds the student's code gets in one whole grade: the unit checks together, plus
    each end-to-end check's deadline (e.g. 7 unit checks and 1 end-to-end: 30 + 90 = 120 s)."""
    return UNIT_CHECKS_BUDGET_S + sum(check.deadline_s for check in checks if check.is_end_to_end)


# ------------------------------------------------------------------ end to end
# Token-id prompts, every id below the tiny test vocabulary (about 320), so the
# same checks run on the tiny random models and on SmolLM2.
PROMPTS = [[5 + i, 17, 33, 40, 41, 42, 50] for i in range(4)]
SHARED_PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PREFIX_PROMPTS = [SHARED_PREFIX + [30 + i, 31 + i] for i in range(3)]
# 9 usable blocks of 4 tokens: four requests that grow to 23 tokens (6 blocks)
# cannot all stay, so the scheduler must preempt.
TIGHT_CACHE: dict[str, Any] = {"max_model_len": 32, "block_size": 4, "num_gpu_blocks_override": 10,
                                "max_num_batched_tokens": 32}
# Every engine gets a fixed, small block count: sized from the machine's RAM it
# would differ between runs (and a million blocks take seconds to set up).
# fp32 pinned: the checks compare texts and token ids with fixed expectations,
# and dtype="auto" would pick bf16 on a CPU with bf16 dot products.
SMALL_BLOCKS: dict[str, Any] = {
    "max_model_len": 64,
    "block_size": 4,
    "num_gpu_blocks_override": 64,
    "dtype": "float32",
}
# An 8-token budget cuts every 7-token prompt into chunks.
SMALL_BUDGET: dict[str, Any] = {**SMALL_BLOCKS, "max_num_batched_tokens": 8}


@dataclass(frozen=True)
class EngineRun:
    """What one greedy generation produced, and what the engine did on the way."""

    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    num_preemptions: int
    prefix_cache_hits: int
    num_blocks: int
    block_size: int  # tokens per attention block, once a hybrid model's states are fitted in


def greedy_run(model: str, prompts: list[list[int]], max_tokens: int = 16,
               priority: list[int] | None = None, **engine_kwargs: Any) -> EngineRun:
    """Build a fresh engine (so construction-time code runs too) and generate greedily."""
    llm = LLM(model=model, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                           priority=priority)
    core = llm.llm_engine.engine_core.get_engine_core()
    stats = core.scheduler.make_stats()
    llm.llm_engine.shutdown()
    return EngineRun(
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        finish_reasons=[o.outputs[0].finish_reason for o in outputs],
        num_preemptions=stats.num_preemptions,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_blocks=core.kv_cache_config.num_blocks,
        block_size=core.kv_cache_config.block_size,
    )


def e2e_preemption(model: str) -> dict[str, Any]:
    """Four 7-token prompts, 16 greedy tokens each, in 9 usable blocks of 4 tokens: FCFS must preempt."""
    run = greedy_run(model, PROMPTS, **TIGHT_CACHE)
    assert run.num_preemptions > 0, "the tight cache was meant to force a preemption"
    return asdict(run)


def e2e_priority_preemption(model: str) -> dict[str, Any]:
    """The same four prompts and tight cache under the priority policy (priorities 3, 0, 2, 1)."""
    run = greedy_run(model, PROMPTS, priority=[3, 0, 2, 1], scheduling_policy="priority", **TIGHT_CACHE)
    assert run.num_preemptions > 0, "the tight cache was meant to force a preemption"
    return asdict(run)


def e2e_prefix_cache(model: str) -> dict[str, Any]:
    """Three prompts sharing a 12-token prefix, 8 greedy tokens each, 4-token blocks: the cache must hit."""
    run = greedy_run(model, PREFIX_PROMPTS, max_tokens=8, **SMALL_BLOCKS)
    assert run.prefix_cache_hits > 0, "the shared prefix was meant to hit the prefix cache"
    return asdict(run)


def e2e_chunked_prefill(model: str) -> dict[str, Any]:
    """Four 7-token prompts under an 8-token budget: prefills are cut into chunks, 8 greedy tokens each."""
    return asdict(greedy_run(model, PROMPTS, max_tokens=8, **SMALL_BUDGET))


def e2e_plain(model: str) -> dict[str, Any]:
    """Four 7-token prompts, 8 greedy tokens each, 64 blocks of 4 tokens."""
    return asdict(greedy_run(model, PROMPTS, max_tokens=8, **SMALL_BLOCKS))


# ------------------------------------------------------------------- helpers
def make_request(request_id: str, num_tokens: int, priority: int = 0, arrival_time: float = 0.0,
             block_size: int | None = None, first_token: int = 1) -> Request:
    from nanoengine.core.kv_cache_utils import get_request_block_hasher

    hasher = get_request_block_hasher(block_size) if block_size else None
    tokens = list(range(first_token, first_token + num_tokens))
    return Request(request_id, tokens, SamplingParams(max_tokens=8),
                   eos_token_id=None, arrival_time=arrival_time, priority=priority, block_hasher=hasher)


def kv_spec(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_dim=16, dtype_size=4, num_layers=2)


def block_ids(blocks: KVCacheBlocks | None) -> tuple[list[int], ...] | None:
    """The ids as the API gives them: one list per KV cache group (one group here)."""
    return None if blocks is None else blocks.get_block_ids()


