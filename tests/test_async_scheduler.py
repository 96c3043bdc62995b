"""AsyncScheduler (chapter 7): output placeholders, driven without a model.

Placeholder accounting step by step with hand-made runner outputs; then the
scheduler pipelined two steps deep over the paged fake worker of
test_scheduler_properties.py (which reads every input back through the block
table), against the synchronous scheduler. Pure Python, no torch. The engine
level is in test_async_scheduling.py.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from test_scheduler import EOS, TOKEN, make_request
from test_scheduler_properties import FakeWorker

from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.async_scheduler import AsyncScheduler
from nanoengine.core.sched.output import SchedulerOutput
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.instruments.invariants import check_invariants
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from nanoengine.outputs import ModelRunnerOutput
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 64, budget: int = 64, max_model_len: int = 64, cls: type[Scheduler] = AsyncScheduler
) -> Scheduler:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1)
    return cls(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=max_model_len),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        KVCacheConfig(num_blocks=num_blocks, spec=spec),
    )


def sampled(output: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    """A runner output giving ``tokens[req_id]`` to each listed scheduled request."""
    req_ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, [[tokens[rid]] if rid in tokens else [] for rid in req_ids])


# ---- placeholder accounting, by hand -------------------------------------------


def test_placeholders_count_up_on_schedule_and_down_on_output() -> None:
    scheduler = make_scheduler()
    request = make_request("r", 6)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"r": 6}
    assert request.num_output_placeholders == 1 and request.num_computed_tokens == 6
    # Scheduled again before the first token is known: the decode's input is
    # that placeholder, and its KV slot (position 6) needs a block.
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"r": 1}
    assert second.scheduled_cached_reqs.num_output_tokens == [1]  # the placeholder the worker fills in
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 7
    assert len(scheduler.kv_cache_manager.get_block_ids("r")[0]) == 2  # 7 slots of 4
    outputs = scheduler.update_from_output(first, sampled(first, {"r": 11}))
    assert request.num_output_placeholders == 1 and request.output_token_ids == [11]
    assert [out.new_token_ids for out in outputs.outputs] == [[11]]
    scheduler.update_from_output(second, sampled(second, {"r": 12}))
    assert request.num_output_placeholders == 0 and request.output_token_ids == [11, 12]
    check_invariants(scheduler)


def test_a_partial_prefill_chunk_books_no_placeholder() -> None:
    scheduler = make_scheduler(budget=4)
    request = make_request("r", 6)
    scheduler.add_request(request)
    chunk = scheduler.schedule()
    assert chunk.num_scheduled_tokens == {"r": 4} and request.num_output_placeholders == 0
    last = scheduler.schedule()
    assert last.num_scheduled_tokens == {"r": 2} and request.num_output_placeholders == 1
    scheduler.update_from_output(chunk, sampled(chunk, {}))
    assert request.num_output_placeholders == 1 and request.output_token_ids == []


def test_tokens_for_a_request_that_already_ended_are_dropped() -> None:
    scheduler = make_scheduler()
    stopper, aborted = make_request("stop", 5), make_request("abort", 5, first_token=200)
    scheduler.add_request(stopper)
    scheduler.add_request(aborted)
    first = scheduler.schedule()
    second = scheduler.schedule()  # both decode on placeholders
    assert second.num_scheduled_tokens == {"stop": 1, "abort": 1}
    scheduler.finish_requests("abort", RequestStatus.FINISHED_ABORTED)
    # The first step's token is EOS: "stop" ends while its next step is in flight.
    outputs = scheduler.update_from_output(first, sampled(first, {"stop": EOS, "abort": TOKEN}))
    assert [(out.request_id, out.finished) for out in outputs.outputs] == [("stop", True)]
    assert not scheduler.has_unfinished_requests()
    check_invariants(scheduler)  # idle: every block back in the pool
    # The id is free again and a new request takes it, scheduled before the
    # late tokens arrive: they belong to the old one and must not leak in.
    reused = make_request("stop", 5, first_token=300)
    scheduler.add_request(reused)
    third = scheduler.schedule()
    assert third.finished_req_ids == {"stop", "abort"} and third.num_scheduled_tokens == {"stop": 5}
    late = scheduler.update_from_output(second, sampled(second, {"stop": TOKEN, "abort": TOKEN}))
    assert late.outputs == [] and not scheduler.finished_in_flight
    assert stopper.output_token_ids == [EOS] and aborted.output_token_ids == []
    assert reused.output_token_ids == [] and reused.num_output_placeholders == 1
    scheduler.update_from_output(third, sampled(third, {"stop": 13}))
    assert reused.output_token_ids == [13]


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_no_step_is_scheduled_past_max_tokens(max_tokens: int) -> None:
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=max_tokens)
    scheduler.add_request(request)
    in_flight: deque[SchedulerOutput] = deque()
    steps_with_r = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        steps_with_r += "r" in output.num_scheduled_tokens
        in_flight.appendleft(output)
        if len(in_flight) == 2 or not output.num_scheduled_tokens:
            oldest = in_flight.pop()
            scheduler.update_from_output(oldest, sampled(oldest, {"r": TOKEN}))
    assert steps_with_r == max_tokens  # one prefill + (max_tokens - 1) decodes, nothing wasted
    assert request.output_token_ids == [TOKEN] * max_tokens
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_no_step_is_scheduled_past_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("r", 6, max_tokens=100)
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"r": 1}  # position 6, the last one with a slot
    assert scheduler.schedule().num_scheduled_tokens == {}  # 6 + 2 placeholders = max_model_len
    scheduler.update_from_output(first, sampled(first, {"r": TOKEN}))
    scheduler.update_from_output(second, sampled(second, {"r": TOKEN}))
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and request.num_tokens == 8


def _preempt_with_token_in_flight(final_token: int) -> tuple[Scheduler, Request]:
    """Two requests in a 3-block pool: the second step preempts ``late`` while its
    first token (sampled by the step still in flight) is unknown."""
    scheduler = make_scheduler(num_blocks=4)  # 3 usable blocks of 4 slots
    early, late = make_request("early", 4), make_request("late", 4, first_token=200)
    scheduler.add_request(early)
    scheduler.add_request(late)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"early": 4, "late": 4}
    second = scheduler.schedule()  # both need a fifth slot: only one block is left
    assert second.num_scheduled_tokens == {"early": 1} and second.preempted_req_ids == {"late"}
    assert late.status == RequestStatus.PREEMPTED and late.num_output_placeholders == 1
    scheduler.update_from_output(first, sampled(first, {"early": TOKEN, "late": final_token}))
    return scheduler, late


def test_a_preempted_request_keeps_its_in_flight_token_and_recomputes_from_real_tokens() -> None:
    scheduler, late = _preempt_with_token_in_flight(final_token=TOKEN)
    assert late.output_token_ids == [TOKEN] and late.num_output_placeholders == 0
    assert late.num_computed_tokens == 0 and late in list(scheduler.waiting)
    check_invariants(scheduler)
    scheduler.finish_requests("early", RequestStatus.FINISHED_ABORTED)
    resumed = scheduler.schedule()
    (new,) = resumed.scheduled_new_reqs
    assert new.req_id == "late" and new.token_ids == [*range(200, 204), TOKEN]
    assert resumed.num_scheduled_tokens["late"] == 5 - new.num_computed_tokens


def test_a_preempted_request_can_stop_in_the_waiting_queue() -> None:
    scheduler, late = _preempt_with_token_in_flight(final_token=EOS)
    assert late.status == RequestStatus.FINISHED_STOPPED
    assert late not in list(scheduler.waiting) and "late" not in scheduler.requests
    check_invariants(scheduler)


# ---- pipelined two deep over a paged fake worker ---------------------------------

Results = dict[str, tuple[list[int], str]]  # request id -> (output tokens, final status)


def _drive(scheduler: Scheduler, depth: int) -> Results:
    """Run to idle with ``depth`` steps in flight; (outputs, status) of each request.

    The fake worker runs each step when it is launched, as the forward thread
    would, so the decode inputs it reads for placeholders are its own samples.
    """
    worker = FakeWorker()
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    results: Results = {}
    for _ in range(2000):
        if not scheduler.has_requests() and not in_flight:
            return results
        if scheduler.has_requests():
            output = scheduler.schedule()
            in_flight.appendleft((output, worker.execute(output)))
            if output.total_num_scheduled_tokens > 0 and len(in_flight) < depth:
                continue
        output, runner_output = in_flight.pop()
        live = dict(scheduler.requests)
        for out in scheduler.update_from_output(output, runner_output).outputs:
            if out.finished:
                request = live[out.request_id]
                results[out.request_id] = (list(request.output_token_ids), request.status.name)
        check_invariants(scheduler)
    raise AssertionError("the scheduler did not drain")


def _random_run(seed: int, scheduler_cls: type[Scheduler], depth: int) -> tuple[Results, int]:
    """A seeded workload (shared prefixes, max_tokens 1 to 30, EOS) on a small pool."""
    rng = random.Random(seed)
    num_blocks, budget = rng.choice([10, 14, 24]), rng.choice([6, 16, 64])
    # The longest request always fits the cache, as the engine guarantees.
    scheduler = make_scheduler(num_blocks, budget, (num_blocks - 1) * BLOCK_SIZE, scheduler_cls)
    for index in range(rng.randint(3, 7)):
        prefix = rng.choice([(), (20, 21, 22, 23)])
        prompt = [*prefix, *(30 + (index * 5 + i) % 50 for i in range(rng.randint(1, 12)))]
        params = SamplingParams(max_tokens=rng.choice([1, 2, 5, 30]))
        scheduler.add_request(
            Request(f"r{index}", prompt, params, eos_token_id=EOS, arrival_time=index,
                    block_hasher=get_request_block_hasher(BLOCK_SIZE))
        )
    return _drive(scheduler, depth), scheduler.num_preemptions


def test_pipelined_async_scheduler_matches_the_synchronous_one() -> None:
    async_preemptions = 0
    for seed in range(8):
        expected, _ = _random_run(seed, Scheduler, depth=1)
        got, preemptions = _random_run(seed, AsyncScheduler, depth=2)
        assert got == expected, f"seed {seed}"
        async_preemptions += preemptions
        statuses = {status for _, status in got.values()}
        assert statuses <= {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"}
    assert async_preemptions > 0, "the small pools were meant to preempt requests with tokens in flight"
