"""Scheduler (chapter 3), driven by a fake model runner: pure Python, no torch.

The fake runner samples one token for every scheduled request whose
``num_computed_tokens`` (already advanced by ``schedule()``) reached its
``num_tokens``, and nothing for a request still in the middle of its prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import pytest

from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.output import SchedulerOutput
from nanoengine.core.sched.request_queue import SchedulingPolicy
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.core.sched.utils import select_preemption_victim, select_victim_for_admission
from nanoengine.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from nanoengine.outputs import ModelRunnerOutput
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2
TOKEN = 7  # an ordinary token: neither EOS nor a stop token


def make_scheduler(
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    policy: Literal["fcfs", "priority"] = "fcfs",
) -> Scheduler:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1)
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=policy,
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        KVCacheConfig(num_blocks=num_blocks, spec=spec),
    )


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    first_token: int = 100,
    arrival_time: float = 0.0,
    priority: int = 0,
    prefix: tuple[int, ...] = (),
    **sampling: object,
) -> Request:
    params = SamplingParams(**{"max_tokens": 16, **sampling})  # type: ignore[arg-type]
    return Request(
        request_id,
        [*prefix, *range(first_token, first_token + num_prompt_tokens - len(prefix))],
        params,
        eos_token_id=EOS,
        arrival_time=arrival_time,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK_SIZE),
    )


def fake_model_runner(
    scheduler: Scheduler, output: SchedulerOutput, token_for: Callable[[Request], int]
) -> ModelRunnerOutput:
    req_ids, sampled = [], []
    for req_id in output.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        req_ids.append(req_id)
        done_prefill = request.num_computed_tokens >= request.num_tokens
        sampled.append([token_for(request)] if done_prefill else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(
    scheduler: Scheduler, token_for: Callable[[Request], int] = lambda _: TOKEN
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, fake_model_runner(scheduler, output, token_for))


def run_to_completion(scheduler: Scheduler, max_steps: int = 200) -> dict[str, EngineCoreOutput]:
    """Step until idle; return each request's final output."""
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return finals
        _, outputs = step(scheduler)
        finals.update({out.request_id: out for out in outputs.outputs if out.finished})
    raise AssertionError("scheduler did not become idle")


def assert_idle_pool(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.usage == 0.0
    assert all(group.req_to_blocks == {} for group in manager.coordinator.single_type_managers)


# ---- budget, chunking, mixing -------------------------------------------------


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 6, first_token=100 * (i + 1)))
    output, _ = step(scheduler)
    # r0 whole, r1 cut to the 4 tokens left; r2 has no seat (max_num_seqs=2).
    assert output.num_scheduled_tokens == {"r0": 6, "r1": 4}
    assert output.total_num_scheduled_tokens == 10
    assert scheduler.get_request_counts() == (2, 1)
    for _ in range(5):
        output, _ = step(scheduler)
        assert output.total_num_scheduled_tokens <= 10 and output.num_reqs <= 2


def test_chunked_prefill_samples_only_after_the_last_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("r", 10))
    first, outputs = step(scheduler)
    assert first.num_scheduled_tokens == {"r": 4} and outputs.outputs == []
    assert first.scheduled_new_reqs[0].block_ids == ([1],)  # one list per KV cache group

    second, outputs = step(scheduler)
    assert second.num_scheduled_tokens == {"r": 4} and outputs.outputs == []
    assert second.scheduled_cached_reqs.req_ids == ["r"]
    assert second.scheduled_cached_reqs.num_computed_tokens == [4]
    assert second.scheduled_cached_reqs.new_block_ids == [([2],)]

    last, outputs = step(scheduler)
    assert last.num_scheduled_tokens == {"r": 2}  # the short last chunk
    assert [out.new_token_ids for out in outputs.outputs] == [[TOKEN]]
    assert scheduler.requests["r"].num_computed_tokens == 10


def test_prefill_and_decode_share_one_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("old", 4))
    step(scheduler)
    scheduler.add_request(make_request("new", 6, first_token=300))
    output, outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"old": 1, "new": 6}
    assert output.scheduled_cached_reqs.req_ids == ["old"]
    assert output.scheduled_cached_reqs.new_block_ids == [([2],)]  # token 5 opens block 2
    new_data = output.scheduled_new_reqs[0]
    assert (new_data.req_id, new_data.num_prompt_tokens, new_data.num_computed_tokens) == ("new", 6, 0)
    assert new_data.token_ids == list(range(300, 306))
    assert {out.request_id for out in outputs.outputs} == {"old", "new"}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_blocks_the_queue() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10, first_token=200))
    scheduler.add_request(make_request("c", 3, first_token=300))
    output, _ = step(scheduler)
    # b would need 10 of the 6 tokens left; c waits behind it (FCFS order).
    assert output.num_scheduled_tokens == {"a": 10}
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 10, "c": 3}


def test_blocked_waiting_requests_are_skipped_in_place() -> None:
    scheduler = make_scheduler()
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, 4))
    scheduler.requests["b"].status = RequestStatus.WAITING_FOR_REMOTE_KVS
    output, _ = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"a", "c"}
    assert [request.request_id for request in scheduler.waiting] == ["b"]


# ---- preemption -----------------------------------------------------------------


def test_preemption_picks_the_newest_running_request_and_requeues_it_first() -> None:
    # 5 usable blocks: a (2) + b (1) + c (2) fill the cache; d has no seat.
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=3)
    scheduler.add_request(make_request("a", 8, first_token=100))
    scheduler.add_request(make_request("b", 4, first_token=200))
    scheduler.add_request(make_request("c", 8, first_token=300))
    scheduler.add_request(make_request("d", 4, first_token=400))
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    # Now a and c need a third block, b a second: c (newest) is preempted.
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"c"}
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}  # no admissions after a preemption
    victim = scheduler.requests["c"]
    assert (victim.status, victim.num_computed_tokens, victim.num_preemptions) == (
        RequestStatus.PREEMPTED,
        0,
        1,
    )
    assert [request.request_id for request in scheduler.waiting] == ["c", "d"]
    assert scheduler.make_stats().num_preemptions == 1


def test_preempted_request_resumes_from_the_prefix_cache() -> None:
    # 5 usable blocks; a and c each hold 2 and both need a third next step.
    scheduler = make_scheduler(num_blocks=6)
    scheduler.add_request(make_request("a", 8, first_token=100, max_tokens=2))
    scheduler.add_request(make_request("c", 8, first_token=300))
    step(scheduler)
    output, outputs = step(scheduler)  # a takes the last block; c preempts itself
    assert output.preempted_req_ids == {"c"} and output.num_scheduled_tokens == {"a": 1}
    assert [out.finish_reason for out in outputs.outputs] == [FinishReason.LENGTH]  # a is done

    output, _ = step(scheduler)
    resumed = output.scheduled_new_reqs[0]
    # c's two full blocks survived in the cache: only its 9th token is recomputed.
    assert resumed.req_id == "c" and resumed.num_computed_tokens == 8
    assert resumed.token_ids == list(range(300, 308)) + [TOKEN]
    assert output.num_scheduled_tokens == {"c": 1}
    assert scheduler.requests["c"].num_cached_tokens == 0  # set on the first schedule only
    assert scheduler.make_stats().prefix_cache_hits == 8


def test_priority_policy_preempts_a_request_already_scheduled_this_step() -> None:
    scheduler = make_scheduler(num_blocks=6, policy="priority")  # 5 usable blocks
    scheduler.add_request(make_request("low", 8, first_token=100, priority=1, arrival_time=0.0))
    step(scheduler)
    scheduler.add_request(make_request("high", 8, first_token=300, priority=0, arrival_time=1.0))
    step(scheduler)  # low: 3 blocks, high: 2 blocks -> cache full

    # low (scheduled first, needs no block) is booked, then high needs a block:
    # the victim is low, whose booking must vanish from this step's output.
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 1}
    assert output.total_num_scheduled_tokens == 1
    assert output.scheduled_cached_reqs.req_ids == ["high"]
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED


def test_priority_waiting_request_preempts_a_lower_priority_runner() -> None:
    scheduler = make_scheduler(num_blocks=6, policy="priority")  # 5 usable blocks
    scheduler.add_request(make_request("low", 12, first_token=100, priority=5, arrival_time=0.0))
    step(scheduler)  # low holds 3 blocks, then 4 once its 13th token arrives
    step(scheduler)
    scheduler.add_request(make_request("urgent", 8, first_token=300, priority=0, arrival_time=1.0))
    output, _ = step(scheduler)
    # urgent needs 2 blocks, 1 is free: low (ranked below) is preempted and unbooked.
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"urgent": 8}
    assert [r.request_id for r in scheduler.waiting] == ["low"]
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED


@pytest.mark.parametrize("policy,priority", [("fcfs", 0), ("priority", 5), ("priority", 7)])
def test_newcomers_never_preempt_an_equal_or_better_runner(policy: str, priority: int) -> None:
    scheduler = make_scheduler(num_blocks=6, policy=policy)  # type: ignore[arg-type]
    scheduler.add_request(make_request("first", 12, first_token=100, priority=5, arrival_time=0.0))
    step(scheduler)
    step(scheduler)
    # Same priority arriving later ranks below "first" (ties go by arrival), as does a larger value.
    scheduler.add_request(make_request("late", 8, first_token=300, priority=priority, arrival_time=1.0))
    output, _ = step(scheduler)
    assert output.preempted_req_ids == set() and output.num_scheduled_tokens == {"first": 1}


def test_select_victim_for_admission() -> None:
    running = [make_request("a", 4, priority=1, arrival_time=0.0), make_request("b", 4, priority=3, arrival_time=1.0)]
    newcomer = make_request("n", 4, priority=2, arrival_time=2.0)
    assert select_victim_for_admission(running, newcomer, SchedulingPolicy.PRIORITY) == 1
    assert select_victim_for_admission(running, newcomer, SchedulingPolicy.FCFS) is None
    assert select_victim_for_admission(running[:1], newcomer, SchedulingPolicy.PRIORITY) is None
    assert select_victim_for_admission([], newcomer, SchedulingPolicy.PRIORITY) is None


def test_select_preemption_victim() -> None:
    running = [
        make_request("a", 4, priority=1, arrival_time=0.0),
        make_request("b", 4, priority=2, arrival_time=1.0),
        make_request("c", 4, priority=0, arrival_time=2.0),
        make_request("d", 4, priority=2, arrival_time=0.5),
    ]
    assert select_preemption_victim(running, SchedulingPolicy.FCFS) == 3
    assert select_preemption_victim(running, SchedulingPolicy.PRIORITY) == 1
    with pytest.raises(ValueError, match="no request is running"):
        select_preemption_victim([], SchedulingPolicy.FCFS)


# ---- requests that cannot run ----------------------------------------------------


def test_prompt_longer_than_max_model_len_is_ignored() -> None:
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("long", 17))
    scheduler.add_request(make_request("ok", 4, first_token=300))
    output, outputs = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"ok"}
    ignored = next(out for out in outputs.outputs if out.request_id == "long")
    assert ignored.finish_reason == FinishReason.LENGTH and ignored.new_token_ids == []
    assert ignored.finish_message is not None
    assert "17" in ignored.finish_message and "max_model_len=16" in ignored.finish_message
    assert "long" not in scheduler.requests


def test_prompt_larger_than_the_whole_kv_cache_is_ignored() -> None:
    scheduler = make_scheduler(num_blocks=4)  # 3 usable blocks = 12 tokens
    scheduler.add_request(make_request("big", 13))
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens == 0 and scheduler.has_requests()
    outputs = scheduler.update_from_output(output, ModelRunnerOutput([], []))
    (ignored,) = outputs.outputs
    assert ignored.finish_message is not None and "needs 4 KV cache blocks" in ignored.finish_message
    assert "3 blocks" in ignored.finish_message
    assert not scheduler.has_requests()


# ---- stop conditions ---------------------------------------------------------------


def generate(scheduler: Scheduler, request: Request, token_for: Callable[[Request], int]) -> EngineCoreOutput:
    scheduler.add_request(request)
    while True:
        _, outputs = step(scheduler, token_for)
        for out in outputs.outputs:
            if out.finished:
                return out


def test_stop_on_eos_unless_ignored() -> None:
    scheduler = make_scheduler()
    out = generate(scheduler, make_request("r", 4), lambda _: EOS)
    assert (out.finish_reason, out.stop_reason, out.new_token_ids) == (FinishReason.STOP, None, [EOS])

    request = make_request("s", 4, ignore_eos=True, max_tokens=3)
    out = generate(scheduler, request, lambda _: EOS)
    assert out.finish_reason == FinishReason.LENGTH and request.output_token_ids == [EOS] * 3


def test_stop_on_stop_token_ids_reports_the_token() -> None:
    request = make_request("r", 4, stop_token_ids=[9])
    out = generate(make_scheduler(), request, lambda r: 9 if r.num_output_tokens == 2 else TOKEN)
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, 9)
    assert request.output_token_ids == [TOKEN, TOKEN, 9]
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_min_tokens_delays_the_stop() -> None:
    request = make_request("r", 4, min_tokens=3)
    out = generate(make_scheduler(), request, lambda _: EOS)
    assert out.finish_reason == FinishReason.STOP and request.num_output_tokens == 3


def test_max_tokens_and_max_model_len_cap_the_length() -> None:
    request = make_request("r", 4, max_tokens=3)
    out = generate(make_scheduler(), request, lambda _: TOKEN)
    assert out.finish_reason == FinishReason.LENGTH and request.num_output_tokens == 3
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED

    unlimited = make_request("u", 6, max_tokens=None)
    out = generate(make_scheduler(max_model_len=8), unlimited, lambda _: TOKEN)
    assert out.finish_reason == FinishReason.LENGTH and unlimited.num_tokens == 8


# ---- aborts and the idle engine ------------------------------------------------------


def test_abort_frees_blocks_and_tells_the_worker() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("run", 8))
    scheduler.add_request(make_request("wait", 4, first_token=200))
    output = scheduler.schedule()
    assert scheduler.kv_cache_manager.usage > 0

    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_request_counts() == (0, 0)
    assert_idle_pool(scheduler)
    # The step that was in flight reports nothing for the aborted request.
    runner_output = ModelRunnerOutput(req_ids=["run"], sampled_token_ids=[[TOKEN]])
    assert scheduler.update_from_output(output, runner_output).outputs == []
    assert scheduler.schedule().finished_req_ids == {"run", "wait"}
    assert not scheduler.has_requests()
    with pytest.raises(ValueError, match="FINISHED_"):
        scheduler.finish_requests("x", RequestStatus.RUNNING)


def test_finished_ids_reach_the_worker_exactly_once() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4, max_tokens=1))
    step(scheduler)
    assert "r" not in scheduler.requests and scheduler.has_requests()
    assert scheduler.schedule().finished_req_ids == {"r"}
    assert scheduler.schedule().finished_req_ids == set()


def test_idle_engine_holds_no_blocks_after_a_busy_run() -> None:
    scheduler = make_scheduler(num_blocks=9, max_num_batched_tokens=8, max_num_seqs=4)
    for i in range(6):  # a shared first block, so prefix hits happen too
        request = make_request(
            f"r{i}", 5 + i, first_token=100 * (i + 1), prefix=(1, 2, 3, 4), max_tokens=5 + i
        )
        scheduler.add_request(request)
    finals = run_to_completion(scheduler)
    assert set(finals) == {f"r{i}" for i in range(6)}
    assert all(out.finish_reason == FinishReason.LENGTH for out in finals.values())
    assert scheduler.make_stats().num_preemptions > 0  # the small cache forced some
    assert_idle_pool(scheduler)
    stats = scheduler.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.prefix_cache_hits > 0


# ---- configuration ------------------------------------------------------------------


def test_bad_configurations_are_rejected() -> None:
    with pytest.raises(ValueError, match="must be at least max_model_len=64"):
        make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1, got 0"):
        make_scheduler(max_num_seqs=0)
    with pytest.raises(ValueError, match="policy"):
        make_scheduler(policy="lifo")  # type: ignore[arg-type]
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4))
    with pytest.raises(ValueError, match="already in the scheduler"):
        scheduler.add_request(make_request("r", 4))
