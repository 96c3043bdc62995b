"""The step tracer (chapters 3-4): data, the recorder's taps, table, timeline, LLM.trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from test_scheduler import make_request, make_scheduler, step

from nanoengine import LLM, SamplingParams
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.instruments.trace import EngineTrace, TraceRecorder, save_timeline
from nanoengine.instruments.trace.table import format_chunk, live_table, trace_table
from nanoengine.renderers.hf import TokensPrompt


def traced_scheduler(**kwargs: object) -> tuple[Scheduler, TraceRecorder]:
    """A scheduler watched by a TraceRecorder, stepped by the fake runner."""
    scheduler = make_scheduler(**kwargs)  # type: ignore[arg-type]
    return scheduler, TraceRecorder.attach(scheduler)


def traced_step(scheduler: Scheduler, recorder: TraceRecorder) -> None:
    step(scheduler)  # schedule() then update_from_output(): one StepTrace


def test_recorder_sees_chunks_blocks_hits_preemption_and_finish() -> None:
    # 5 usable blocks: a and c hold 2 each; next step a takes the last, c preempts itself.
    scheduler, recorder = traced_scheduler(num_blocks=6)
    scheduler.add_request(make_request("a", 8, max_tokens=2))
    scheduler.add_request(make_request("c", 8, first_token=300, max_tokens=2))
    while scheduler.has_requests():
        traced_step(scheduler, recorder)
    steps = recorder.trace.steps
    assert steps[0].arrived == ["a", "c"]
    assert [format_chunk(c) for c in steps[0].scheduled] == ["a:P0-7", "c:P0-7"]
    assert [c.new_block_ids for c in steps[0].scheduled] == [[1, 2], [3, 4]]
    assert steps[0].kv_usage == pytest.approx(4 / 5) and steps[0].num_running == 2
    assert [format_chunk(c) for c in steps[1].scheduled] == ["a:D"]
    assert [(p.victim_id, p.reason, p.for_request_id) for p in steps[1].preemptions] == [
        ("c", "out of KV blocks", "c")
    ]
    # c gave its blocks back when preempted, a when it finished.
    assert steps[1].freed_block_ids == {"c": [3, 4], "a": [1, 2, 5]}
    assert steps[1].finished == {"a": "FINISHED_LENGTH_CAPPED"}
    resumed = steps[2].scheduled[0]
    # c's two full blocks survived as cached free blocks: only its 9th token is recomputed.
    assert (resumed.request_id, resumed.kind, resumed.num_cached_tokens, resumed.num_tokens) == (
        "c",
        "recompute",
        8,
        1,
    )
    assert recorder.trace.num_preemptions == 1 and recorder.trace.prefix_cache_hit_rate > 0


@pytest.mark.parametrize(("num_blocks", "reason"), [(6, "out of KV blocks"), (5, "priority")])
def test_preempted_victims_chunk_disappears_from_its_step(num_blocks: int, reason: str) -> None:
    """The reason names who asked: with 6 blocks, running "high" runs out of blocks
    for a decode; with 5, admitting waiting "high" already needs "low"'s blocks.
    """
    scheduler, recorder = traced_scheduler(num_blocks=num_blocks, policy="priority")
    scheduler.add_request(make_request("low", 8, priority=1, arrival_time=0.0))
    traced_step(scheduler, recorder)
    scheduler.add_request(make_request("high", 8, first_token=300, priority=0, arrival_time=1.0))
    traced_step(scheduler, recorder)
    traced_step(scheduler, recorder)
    (preempting,) = [step for step in recorder.trace.steps if step.preemptions]
    assert [c.request_id for c in preempting.scheduled] == ["high"]
    assert [(p.victim_id, p.reason, p.for_request_id) for p in preempting.preemptions] == [("low", reason, "high")]


def test_request_timelines_fold_steps_into_segments() -> None:
    scheduler, recorder = traced_scheduler(num_blocks=6, max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", 8, max_tokens=2))
    scheduler.add_request(make_request("c", 8, first_token=300, max_tokens=3))
    while scheduler.has_requests():
        traced_step(scheduler, recorder)
    timelines = {t.request_id: t for t in recorder.trace.request_timelines()}
    assert [s.state for s in timelines["a"].segments] == ["prefill", "decode"]
    assert [s.state for s in timelines["c"].segments] == ["waiting", "prefill", "decode"]
    assert timelines["c"].finish_status == "FINISHED_LENGTH_CAPPED"
    assert timelines["c"].finished_step == sum(s.num_steps for s in timelines["c"].segments) - 1


def test_timeline_shows_preemption_then_waiting_then_recompute() -> None:
    scheduler, recorder = traced_scheduler(num_blocks=6)
    scheduler.add_request(make_request("a", 8, max_tokens=3))
    scheduler.add_request(make_request("c", 8, first_token=300, max_tokens=3))
    while scheduler.has_requests():
        traced_step(scheduler, recorder)
    (c_timeline,) = [t for t in recorder.trace.request_timelines() if t.request_id == "c"]
    assert [s.state for s in c_timeline.segments] == [
        "prefill",
        "preempted",
        "waiting",
        "recompute",
        "decode",
    ]


def test_an_untraced_scheduler_has_nothing_tapped() -> None:
    """Tracing off costs nothing: every method is the class's own, unwrapped."""
    scheduler = make_scheduler()
    manager = scheduler.kv_cache_manager
    for obj in (scheduler, manager, manager.block_pool):
        assert not any(callable(value) for value in vars(obj).values()), type(obj).__name__
    scheduler, _ = traced_scheduler()
    assert "schedule" in vars(scheduler) and "_maybe_evict_cached_block" in vars(scheduler.kv_cache_manager.block_pool)


def test_llm_trace_table_timeline_and_live(tiny_llama: str, tmp_path: Path) -> None:
    llm = LLM(
        tiny_llama, trace=True, max_model_len=64, kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=16
    )
    trace = llm.trace
    assert isinstance(trace, EngineTrace)
    console = Console(record=True, width=200)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=list(range(10, 10 + n))) for n in (20, 5)]
    with live_table(trace, console=console):
        llm.generate(prompts, params, use_tqdm=False)
    assert trace.steps[0].num_scheduled_tokens == 16  # the budget cut the 20-token prompt
    assert [c.num_tokens for _, c in trace.chunks_of("0") if c.kind == "prefill"] == [16, 4]
    assert trace.listeners == []
    assert all(s.schedule_s >= 0 and s.execute_s > 0 for s in trace.steps)
    text = console.export_text()
    assert "r0:P0-15" in text and "r1:P0-4" in text
    console.print(trace_table(trace, last=2))
    paths = save_timeline(trace, tmp_path / "timeline.png", title="test")
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.stat().st_size > 1000 for p in paths)
    trace.clear()
    assert trace.steps == [] and trace.prefix_cache_hit_rate == 0.0


def test_tracing_is_off_by_default_and_env_switch_turns_it_on(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=1 << 22).trace is None
    monkeypatch.setenv("NANOENGINE_TRACE", "1")
    llm = LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert llm.trace is not None and len(llm.trace.steps) == 2


def test_empty_trace_has_no_timeline() -> None:
    with pytest.raises(ValueError, match="no requests"):
        save_timeline(EngineTrace(block_size=16, num_blocks=8), "/tmp/never-written.png")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_scheduling_policy_end_to_end_through_llm(tiny_llama: str, policy: str) -> None:
    """One seat (max_num_seqs=1): the trace's admission order is the policy's order."""
    llm = LLM(
        tiny_llama,
        trace=True,
        scheduling_policy=policy,  # type: ignore[arg-type]
        max_num_seqs=1,
        max_model_len=64,
        kv_cache_memory_bytes=1 << 22,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(range(10 + i, 20 + i))) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # Lower value = more urgent; "1" and "3" tie on 0 and keep their arrival order.
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1, 0])
    assert [o.request_id for o in outs] == ["0", "1", "2", "3"]  # results stay in prompt order
    trace = llm.trace
    assert trace is not None
    admitted = [c.request_id for s in trace.steps for c in s.scheduled if c.kind == "prefill"]
    assert admitted == (["0", "1", "2", "3"] if policy == "fcfs" else ["1", "3", "2", "0"])
    # SamplingParams.priority is the same knob, per request.
    per_request = [SamplingParams(temperature=0.0, max_tokens=1, priority=p) for p in (1, 0)]
    trace.clear()
    llm.generate(prompts[:2], per_request, use_tqdm=False)
    admitted = [c.request_id for s in trace.steps for c in s.scheduled]
    assert admitted == (["4", "5"] if policy == "fcfs" else ["5", "4"])
