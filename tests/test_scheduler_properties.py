"""Property tests: Scheduler + KVCacheManager under random arrivals, aborts and tiny pools.

A fake worker keeps its own block tables, *writes every scheduled token into
the paged "KV cache"* (a dict of blocks) and computes each next token from the
tokens it *reads back through the block table*. So a block shared by mistake,
a prefix-cache hit on the wrong block, or a block reused while still needed
changes the output. Every finished request must produce exactly what the same
request produces when it runs alone, and the invariants of
``instruments/invariants.py`` must hold after every rule.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.output import SchedulerOutput
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.instruments.invariants import check_invariants
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from nanoengine.outputs import ModelRunnerOutput
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2
# Shared prefixes make prefix-cache hits (and shared blocks) frequent.
PREFIXES = [(), (20, 21, 22, 23), (20, 21, 22, 23, 24, 25, 26, 27)]


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of every token so far (sometimes EOS)."""
    digest = sum((index + 1) * token for index, token in enumerate(tokens)) % 97
    return EOS if digest == 0 else 10 + digest % 40


class FakeWorker:
    """Mirrors the worker's per-request state and runs a step over a paged token store."""

    def __init__(self) -> None:
        self.kv: dict[int, list[int | None]] = {}  # block id -> the token written at each slot
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids | output.preempted_req_ids:
            self.tokens.pop(req_id, None)
            self.block_ids.pop(req_id, None)
        starts: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            (self.block_ids[new.req_id],) = (list(ids) for ids in new.block_ids)  # one group
            starts[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            (new_ids,) = new_blocks
            self.block_ids[req_id].extend(new_ids)
            starts[req_id] = computed
        # All writes of the step first, then all reads, as the real runner does per layer.
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            for position in range(starts[req_id], starts[req_id] + num_tokens):
                self._slot_write(req_id, position)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            end = starts[req_id] + num_tokens
            req_ids.append(req_id)
            if end < len(self.tokens[req_id]):
                sampled.append([])  # a prefill chunk that is not the last one
                continue
            seen = [self._slot_read(req_id, position) for position in range(end)]
            token = next_token(seen)
            self.tokens[req_id].append(token)
            sampled.append([token])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _slot_write(self, req_id: str, position: int) -> None:
        block_id = self.block_ids[req_id][position // BLOCK_SIZE]
        self.kv.setdefault(block_id, [None] * BLOCK_SIZE)[position % BLOCK_SIZE] = self.tokens[req_id][
            position
        ]

    def _slot_read(self, req_id: str, position: int) -> int:
        value = self.kv[self.block_ids[req_id][position // BLOCK_SIZE]][position % BLOCK_SIZE]
        assert value is not None, f"{req_id} reads an empty slot at position {position}"
        return value


def make_scheduler(num_blocks: int, budget: int, max_num_seqs: int, policy: str) -> Scheduler:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1)
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            # The engine guarantees one longest request fits the cache; so do we.
            max_model_len=(num_blocks - 1) * BLOCK_SIZE,
            policy=policy,  # type: ignore[arg-type]
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        KVCacheConfig(num_blocks=num_blocks, spec=spec),
    )


def drive(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 400) -> dict[str, tuple[list[int], str]]:
    """Step until idle; return (output tokens, final status) of every request that ended."""
    results: dict[str, tuple[list[int], str]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return results
        results.update(one_step(scheduler, worker))
    raise AssertionError("the scheduler did not drain")


def one_step(scheduler: Scheduler, worker: FakeWorker) -> dict[str, tuple[list[int], str]]:
    live = dict(scheduler.requests)
    output = scheduler.schedule()
    outputs = scheduler.update_from_output(output, worker.execute(output))
    return {
        out.request_id: (list(live[out.request_id].output_token_ids), live[out.request_id].status.name)
        for out in outputs.outputs
        if out.finished
    }


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps and aborts against one scheduler; checks after every rule."""

    @initialize(
        num_blocks=st.integers(4, 10),
        budget=st.integers(3, 16),
        max_num_seqs=st.integers(1, 4),
        policy=st.sampled_from(["fcfs", "priority"]),
    )
    def setup(self, num_blocks: int, budget: int, max_num_seqs: int, policy: str) -> None:
        self.config = (num_blocks, budget, max_num_seqs, policy)
        self.scheduler = make_scheduler(*self.config)
        self.worker = FakeWorker()
        self.clock = itertools.count()
        self.requests: dict[str, Request] = {}
        self.results: dict[str, tuple[list[int], str]] = {}
        self.aborted: set[str] = set()

    def _new_request(self, request_id: str, prompt: list[int], max_tokens: int, priority: int) -> Request:
        return Request(
            request_id,
            prompt,
            SamplingParams(max_tokens=max_tokens),
            eos_token_id=EOS,
            arrival_time=float(next(self.clock)),
            priority=priority,
            block_hasher=get_request_block_hasher(BLOCK_SIZE),
        )

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(10, 13), min_size=1, max_size=14),
        max_tokens=st.integers(1, 8),
        priority=st.integers(0, 3),
    )
    def add(self, prefix: tuple[int, ...], tail: list[int], max_tokens: int, priority: int) -> None:
        request_id = f"r{len(self.requests)}"
        request = self._new_request(request_id, [*prefix, *tail], max_tokens, priority)
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    @rule()
    def step(self) -> None:
        self.results.update(one_step(self.scheduler, self.worker))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(self.scheduler.requests)
        if not live:
            return
        request_id = data.draw(st.sampled_from(live))
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(request_id)

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        if hasattr(self, "scheduler"):
            check_invariants(self.scheduler)

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        self.results.update(drive(self.scheduler, self.worker))
        check_invariants(self.scheduler)
        assert self.scheduler.kv_cache_manager.usage == 0.0
        for request_id, request in self.requests.items():
            if request_id in self.aborted:
                continue
            alone = make_scheduler(*self.config)
            twin = self._new_request(
                request_id, request.prompt_token_ids, request.max_tokens or 1, request.priority
            )
            alone.add_request(twin)
            expected = drive(alone, FakeWorker())[request_id]
            assert self.results[request_id] == expected, f"{request_id} differs from its solo run"


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerProperties = SchedulerMachine.TestCase
