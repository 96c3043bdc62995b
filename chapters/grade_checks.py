"""What the grader runs for each exercise: unit checks and a short end-to-end generation.

Every check is a function of the model directory that returns plain data. The
grader (``chapters/grade.py``) runs it once with the reference code and once with
the student's function swapped into the engine, and the two results must be
equal. Checks also assert properties of their own (the budget adds up, the
engine really preempted, the prefix cache really hit), so the reference passes
for a reason and an end-to-end run cannot pass without exercising the code.

Chapters 1, 3-7 (one group of checks per exercise). vLLM 0.32 counterpart: none
(teaching material).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

import chapters.ex01_engine_by_hand as ex01
from nanoengine import LLM, SamplingParams
from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from nanoengine.core.kv_cache_sizing import num_blocks_from_budget
from nanoengine.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
from nanoengine.core.sched.request_queue import SchedulingPolicy
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.core.sched.step_plan import StepPlan
from nanoengine.core.sched.utils import select_preemption_victim
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.request import Request, RequestStatus
from nanoengine.worker.input_batch import compute_slot_mapping


@dataclass(frozen=True)
class Check:
    """One named comparison: ``run(model_dir)`` must give the reference's result."""

    name: str
    run: Callable[[str], Any]


# ------------------------------------------------------------------ end to end
# Token-id prompts, every id below the tiny test vocabulary (about 320), so the
# same checks run on the tiny random models and on SmolLM2.
_PROMPTS = [[5 + i, 17, 33, 40, 41, 42, 50] for i in range(4)]
_SHARED_PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
_PREFIX_PROMPTS = [_SHARED_PREFIX + [30 + i, 31 + i] for i in range(3)]
# 9 usable blocks of 4 tokens: four requests that grow to 23 tokens (6 blocks)
# cannot all stay, so the scheduler must preempt.
_TIGHT_CACHE: dict[str, Any] = {"max_model_len": 32, "block_size": 4, "num_gpu_blocks_override": 10,
                                "max_num_batched_tokens": 32}
# Every engine gets a fixed, small block count: sized from the machine's RAM it
# would differ between runs (and a million blocks take seconds to set up).
_SMALL_BLOCKS: dict[str, Any] = {"max_model_len": 64, "block_size": 4, "num_gpu_blocks_override": 64}
# An 8-token budget cuts every 7-token prompt into chunks.
_SMALL_BUDGET: dict[str, Any] = {**_SMALL_BLOCKS, "max_num_batched_tokens": 8}


@dataclass(frozen=True)
class EngineRun:
    """What one greedy generation produced, and what the engine did on the way."""

    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    num_preemptions: int
    prefix_cache_hits: int
    num_blocks: int


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
    )


def e2e_preemption(model: str) -> dict[str, Any]:
    run = greedy_run(model, _PROMPTS, **_TIGHT_CACHE)
    assert run.num_preemptions > 0, "the tight cache was meant to force a preemption"
    return asdict(run)


def e2e_priority_preemption(model: str) -> dict[str, Any]:
    run = greedy_run(model, _PROMPTS, priority=[3, 0, 2, 1], scheduling_policy="priority", **_TIGHT_CACHE)
    assert run.num_preemptions > 0, "the tight cache was meant to force a preemption"
    return asdict(run)


def e2e_prefix_cache(model: str) -> dict[str, Any]:
    run = greedy_run(model, _PREFIX_PROMPTS, max_tokens=8, **_SMALL_BLOCKS)
    assert run.prefix_cache_hits > 0, "the shared prefix was meant to hit the prefix cache"
    return asdict(run)


def e2e_chunked_prefill(model: str) -> dict[str, Any]:
    return asdict(greedy_run(model, _PROMPTS, max_tokens=8, **_SMALL_BUDGET))


def e2e_plain(model: str) -> dict[str, Any]:
    return asdict(greedy_run(model, _PROMPTS, max_tokens=8, **_SMALL_BLOCKS))


# ------------------------------------------------------------------- helpers
def _request(request_id: str, num_tokens: int, priority: int = 0, arrival_time: float = 0.0,
             block_size: int | None = None, first_token: int = 1) -> Request:
    from nanoengine.core.kv_cache_utils import get_request_block_hasher

    hasher = get_request_block_hasher(block_size) if block_size else None
    tokens = list(range(first_token, first_token + num_tokens))
    return Request(request_id, tokens, SamplingParams(max_tokens=8),
                   eos_token_id=None, arrival_time=arrival_time, priority=priority, block_hasher=hasher)


def _spec(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_dim=16, dtype_size=4, num_layers=2)


def _ids(blocks: KVCacheBlocks | None) -> list[int] | None:
    return None if blocks is None else blocks.get_block_ids()


# ------------------------------------------------------------ 1.1 by hand
def by_hand_output(model: str) -> dict[str, Any]:
    llm = LLM(model=model, **_SMALL_BLOCKS)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    output = ex01.run_to_completion(llm.llm_engine, "by-hand", TokensPrompt(prompt_token_ids=_PROMPTS[0]), params)
    assert output.finished and output.request_id == "by-hand"
    expected = llm.generate([TokensPrompt(prompt_token_ids=_PROMPTS[0])], params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == list(expected.outputs[0].token_ids), "differs from generate()"
    return {"request_id": output.request_id, "token_ids": list(output.outputs[0].token_ids),
            "finish_reason": output.outputs[0].finish_reason}


# ------------------------------------------------------------ 3.1 StepPlan.add
def budget_bookings(model: str) -> dict[str, Any]:
    plan = StepPlan(token_budget=100)
    new, decode, chunk = _request("new", 7), _request("decode", 9), _request("chunk", 40)
    plan.add(new, 7, KVCacheBlocks(), is_new=True)
    plan.add(decode, 1, KVCacheBlocks([KVCacheBlock(5), KVCacheBlock(9)]), is_new=False)
    plan.add(chunk, 30, KVCacheBlocks([KVCacheBlock(3)]), is_new=False)
    after_add = plan.token_budget
    plan.undo(decode)  # undo relies on what add recorded
    assert plan.token_budget + sum(plan.num_scheduled_tokens.values()) == 100, "budget does not add up"
    return {"after_add": after_add, "after_undo": plan.token_budget,
            "num_scheduled_tokens": dict(plan.num_scheduled_tokens),
            "new_reqs": [r.request_id for r in plan.new_reqs],
            "cached_reqs": [r.request_id for r in plan.cached_reqs],
            "new_block_ids": dict(plan.new_block_ids)}


# ----------------------------------------------- 3.2 select_preemption_victim
def victim_choices(model: str) -> dict[str, Any]:
    shapes = [(0, 1.0), (2, 0.5), (2, 3.0), (1, 9.0), (2, 3.0)]
    running = [_request(f"r{i}", 4, priority=p, arrival_time=t) for i, (p, t) in enumerate(shapes)]
    choices: dict[str, Any] = {}
    for policy in SchedulingPolicy:
        choices[policy.value] = [select_preemption_victim(running[:n], policy) for n in range(1, len(running) + 1)]
    assert choices["fcfs"] == list(range(len(running))), "FCFS preempts the newest request"
    try:
        select_preemption_victim([], SchedulingPolicy.FCFS)
        choices["empty"] = "no error"
    except ValueError:
        choices["empty"] = "ValueError"
    return choices


# -------------------------------------------------- 4.1 allocate_slots
def allocation_sequence(model: str) -> list[Any]:
    manager = KVCacheManager(KVCacheConfig(num_blocks=9, spec=_spec()), max_model_len=64, enable_caching=True)
    trace: list[Any] = []
    first = _request("first", 10, block_size=4)
    trace.append(_ids(manager.allocate_slots(first, 10)))  # a 10-token prefill: 3 blocks
    first.num_computed_tokens = 10
    first.append_output_token_ids(99)
    trace.append(_ids(manager.allocate_slots(first, 1)))  # the 11th token fits block 3
    first.num_computed_tokens = 11
    for token in (98, 97):
        first.append_output_token_ids(token)
    trace.append(_ids(manager.allocate_slots(first, 2)))  # 13 tokens: a 4th block
    twin = _request("twin", 10, block_size=4)  # same tokens: its first 2 blocks are cached
    hits, num_hit_tokens = manager.get_computed_blocks(twin)
    assert num_hit_tokens == 8, "the twin should find its first two blocks in the prefix cache"
    trace.append(_ids(manager.allocate_slots(twin, 10 - num_hit_tokens, num_hit_tokens, hits)))
    trace.append(manager.get_block_ids("twin"))
    trace.append(_ids(manager.allocate_slots(_request("huge", 40), 40)))  # needs 10: all or nothing
    trace.append(manager.num_free_blocks)
    # A KV connector still loading these blocks: they must not be prefix-cache hits yet.
    loading = _request("loading", 8, block_size=4, first_token=200)
    trace.append(_ids(manager.allocate_slots(loading, 8, delay_cache_blocks=True)))
    trace.append(manager.get_computed_blocks(_request("early", 8, block_size=4, first_token=200))[1])
    trace.append(manager.num_free_blocks)
    try:
        manager.allocate_slots(_request("zero", 3), 0)
        trace.append("no error")
    except ValueError:
        trace.append("ValueError")
    return trace


# --------------------------------------------------- 4.2 hash_block_tokens
def chained_hashes(model: str) -> list[str]:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    second = hash_block_tokens(first, [5, 6, 7, 8])
    alone = hash_block_tokens(None, [5, 6, 7, 8])
    big = hash_block_tokens(second, [2**40, 0, 7, 2**31])
    assert isinstance(first, bytes) and second != alone, "the parent hash must change the result"
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first, "hashing must be deterministic"
    return [h.hex() for h in (first, second, alone, big)]


# ------------------------------------------ 4.3 FreeKVCacheBlockQueue.remove
def free_queue_removals(model: str) -> list[Any]:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    trace: list[Any] = []
    for block_id in (2, 0, 5):  # middle, head, tail
        queue.remove(blocks[block_id])
        trace.append(([b.block_id for b in queue.get_all_free_blocks()], queue.num_free_blocks))
        assert blocks[block_id].prev_free_block is None and blocks[block_id].next_free_block is None
    trace.append(queue.popleft().block_id)
    queue.append(blocks[2])
    trace.append(([b.block_id for b in queue.get_all_free_blocks()], queue.num_free_blocks))
    assert len(queue.get_all_free_blocks()) == queue.num_free_blocks
    try:
        queue.remove(blocks[0])
        trace.append("no error")
    except RuntimeError:
        trace.append("RuntimeError")
    return trace


# ------------------------------------------------ 5.1 RequestStatus.is_finished
def finished_states(model: str) -> dict[str, bool]:
    table = {status.name: RequestStatus.is_finished(status) for status in RequestStatus}
    assert table == {s.name: s > RequestStatus.PREEMPTED for s in RequestStatus}
    request = _request("r", 3)
    request.status = RequestStatus.FINISHED_ABORTED
    table["Request.is_finished"] = request.is_finished()
    return table


def e2e_abort(model: str) -> dict[str, Any]:
    """Abort one of two running requests; the other must finish unchanged."""
    llm = LLM(model=model, **_SMALL_BLOCKS)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for request_id, prompt in (("kept", _PROMPTS[0]), ("aborted", _PROMPTS[1])):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    outputs = engine.step() + engine.step()
    engine.abort_request("aborted")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.shutdown()
    final = {o.request_id: (list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs}
    assert final["kept"][1] == "length" and len(final["kept"][0]) == 8
    return final


# ----------------------------------------- 5.2 Scheduler._handle_blocked_waiting_request
def _small_scheduler() -> Scheduler:
    """A scheduler over 16 blocks of 4 tokens, for calling its methods directly."""
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        KVCacheConfig(num_blocks=16, spec=_spec()),
    )


def promotions(model: str) -> list[Any]:
    scheduler = _small_scheduler()
    promote = scheduler._handle_blocked_waiting_request
    trace: list[Any] = []
    plain = _request("plain", 4)
    trace.append((promote(plain), str(plain.status)))
    for preempted_before in (0, 1):
        remote = _request(f"remote{preempted_before}", 4)
        remote.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        remote.num_preemptions = preempted_before
        scheduler.finished_recving_kv_req_ids = set()
        trace.append((promote(remote), str(remote.status)))
        scheduler.finished_recving_kv_req_ids.add(remote.request_id)
        trace.append((promote(remote), str(remote.status), sorted(scheduler.finished_recving_kv_req_ids)))
    stream = _request("stream", 6)
    stream.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    stream.num_computed_tokens = 6
    trace.append((promote(stream), str(stream.status)))
    stream.append_prompt_token_ids([7, 8])
    trace.append((promote(stream), str(stream.status)))
    assert trace[0] == (True, "WAITING") and trace[2][:2] == (True, "WAITING")
    return trace


def e2e_streaming_prompt(model: str) -> dict[str, Any]:
    """A prompt sent in three pieces, next to an ordinary request."""
    llm = LLM(model=model, **_SMALL_BLOCKS)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("plain", TokensPrompt(prompt_token_ids=_PROMPTS[1]), params)
    engine.add_request("stream", TokensPrompt(prompt_token_ids=_PROMPTS[0][:3]), params, streaming=True)
    pieces = [(_PROMPTS[0][3:5], False), (_PROMPTS[0][5:], True)]
    finished: dict[str, list[int]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        if pieces:
            piece, final = pieces.pop(0)
            engine.append_prompt("stream", piece, final=final)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    engine.shutdown()
    assert set(finished) == {"plain", "stream"}, f"finished: {sorted(finished)}"
    return finished


# --------------------------------------------------- 6.1 num_blocks_from_budget
def budget_to_blocks(model: str) -> list[int]:
    counts = []
    for spec in (_spec(4), _spec(16)):
        page = spec.page_size_bytes
        for budget in (0, page - 1, page, 10 * page + 7, 2**34, -5):
            counts.append(num_blocks_from_budget(budget, spec))
    assert counts[:4] == [0, 0, 1, 10]
    return counts


def e2e_memory_budget(model: str) -> dict[str, Any]:
    # 6 MB: thousands of blocks on the tiny test model, 32 on SmolLM2.
    run = greedy_run(model, _PROMPTS, max_tokens=8, kv_cache_memory_bytes=6_000_000, max_model_len=64,
                     block_size=4)
    return asdict(run)


# --------------------------------------------------- 7.1 compute_slot_mapping
def slot_mappings(model: str) -> list[list[int]]:
    rng = random.Random(0)
    results = []
    for block_size in (1, 4, 16):
        num_reqs, width = 3, 5
        ids = rng.sample(range(1, 64), num_reqs * width)
        table = torch.tensor(ids, dtype=torch.int32).reshape(num_reqs, width)
        req_indices = torch.tensor([rng.randrange(num_reqs) for _ in range(20)])
        positions = torch.tensor([rng.randrange(width * block_size) for _ in range(20)])
        slots = compute_slot_mapping(table, req_indices, positions, block_size)
        assert slots.dtype == torch.int64 and slots.shape == (20,)
        results.append(slots.tolist())
    return results


CHECKS: dict[str, tuple[Check, ...]] = {
    "1.1": (Check("returns the finished output, equal to generate()", by_hand_output),),
    "3.1": (Check("add books tokens and pays from the budget", budget_bookings),
            Check("end to end: chunked prefill under an 8-token budget", e2e_chunked_prefill)),
    "3.2": (Check("victims under FCFS and priority", victim_choices),
            Check("end to end: preemption, FCFS", e2e_preemption),
            Check("end to end: preemption, priority", e2e_priority_preemption)),
    "4.1": (Check("allocation, growth, cache hits, all-or-nothing", allocation_sequence),
            Check("end to end: prefix cache", e2e_prefix_cache),
            Check("end to end: preemption", e2e_preemption)),
    "4.2": (Check("chained, deterministic hashes", chained_hashes),
            Check("end to end: prefix cache", e2e_prefix_cache)),
    "4.3": (Check("unlink from middle, head and tail", free_queue_removals),
            Check("end to end: prefix cache", e2e_prefix_cache),
            Check("end to end: preemption", e2e_preemption)),
    "5.1": (Check("finished states", finished_states),
            Check("end to end: generation with an abort", e2e_abort)),
    "5.2": (Check("promotion out of the WAITING_FOR_* states", promotions),
            Check("end to end: a prompt streamed in three pieces", e2e_streaming_prompt)),
    "6.1": (Check("blocks from a byte budget", budget_to_blocks),
            Check("end to end: KV cache sized from a byte budget", e2e_memory_budget)),
    "7.1": (Check("slots of random block tables", slot_mappings),
            Check("end to end: several requests, 4-token blocks", e2e_plain)),
}
