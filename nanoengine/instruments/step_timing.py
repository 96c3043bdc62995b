"""Timers from outside: where each ``EngineCore.step()`` went, and ``LLM(...)``'s construction.

``time_construction()`` (chapter 6) times the construction steps of every
engine built inside a ``with`` block: the executor's constructor (the worker's
``init_device`` and ``load_model``), ``determine_available_memory``,
``initialize_from_config`` and ``compile_or_warm_up_model``.

``StepTimer`` (chapter 5) (engine skeleton) uses it to show the point of
``execute_model(..., non_block=True)``: the forward pass runs on the forward
thread while the engine thread builds the grammar bitmask, and only then waits
in ``future.result()``. ``StepTimer.attach(engine_core)`` watches the calls
``step()`` makes (``nanoengine/instruments/method_taps.py``) and stamps the clock at
their boundaries, so ``step()`` itself contains no timing code. The marks:

    start        schedule() begins
    launched     schedule() returned; execute_model() launches the forward pass
    bitmask_end  get_grammar_bitmask() returned (engine-thread work beside the forward)
    result_end   future.result() returned; sample_tokens() begins
    sampled      update_from_output() begins
    updated      update_from_output() returned

The end of the forward pass is stamped by the forward thread itself (a done
callback on the future ``execute_model`` returns).

vLLM 0.32 counterpart: none as a record; ``EngineCore.step`` in
``vllm/v1/engine/core.py`` has the same overlap, measured there with profilers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoengine.instruments.method_taps import tap, time_class_calls

if TYPE_CHECKING:  # annotations only: the timer watches an engine core, it does not build one
    from nanoengine.core.sched.output import SchedulerOutput
    from nanoengine.engine.core import EngineCore


# The construction steps, as chapter 6 names them, in the order EngineCore runs them.
CONSTRUCTION_STEPS = {
    "__init__": "init_device + load_model",
    "determine_available_memory": "determine_available_memory",
    "initialize_from_config": "initialize_from_config",
    "compile_or_warm_up_model": "compile_or_warm_up_model",
}


@contextlib.contextmanager
def time_construction() -> Iterator[dict[str, float]]:
    """Seconds per construction step of the engine built inside the block (the last one, if several).

    ``with time_construction() as steps: llm = LLM(...)``. Every executor
    inherits these four methods from ``Executor``, so timing them there times
    any executor; in-process engines only (a core in its own process is built
    where this block cannot see it).
    """
    from nanoengine.executor.abstract import Executor

    with time_class_calls(Executor, CONSTRUCTION_STEPS) as seconds:
        yield seconds


@dataclass(frozen=True)
class StepTiming:
    """Seconds spent in each phase of one step (perf_counter clock)."""

    num_scheduled_tokens: int  # 0: nothing could run (e.g. every waiting request blocked)
    schedule_s: float  # Scheduler.schedule()
    forward_s: float  # launch -> forward thread done (execute_model, on the other thread)
    bitmask_s: float  # grammar bitmask, on the engine thread, while the forward ran
    wait_s: float  # engine thread blocked in future.result()
    sample_s: float  # sample_tokens (after the bitmask is known)
    update_s: float  # Scheduler.update_from_output()
    overlap_s: float  # engine-thread work done while the forward pass was still running

    @classmethod
    def from_marks(cls, num_scheduled_tokens: int, marks: dict[str, float]) -> StepTiming:
        """Phases from the clock readings named in the module docstring (and ``forward_end``)."""
        launched, bitmask_end, result_end = marks["launched"], marks["bitmask_end"], marks["result_end"]
        forward_end = marks["forward_end"]
        return cls(
            num_scheduled_tokens=num_scheduled_tokens,
            schedule_s=launched - marks["start"],
            forward_s=forward_end - launched,
            bitmask_s=bitmask_end - launched,
            wait_s=result_end - bitmask_end,
            sample_s=marks["sampled"] - result_end,
            update_s=marks["updated"] - marks["sampled"],
            overlap_s=max(min(bitmask_end, forward_end) - launched, 0.0),
        )


class StepTimer:
    """Collects one ``StepTiming`` per ``EngineCore.step()`` of the core it is attached to."""

    def __init__(self) -> None:
        self.timings: list[StepTiming] = []
        self._marks: dict[str, float] = {}
        self._forward_clock: CompletionClock | None = None

    @classmethod
    def attach(cls, core: EngineCore) -> StepTimer:
        """Watch ``core``'s scheduler and executor; return the timer.

        Only for the synchronous ``step()``: with async scheduling the steps
        overlap each other, and their phases cannot be told apart this way.
        """
        if core.batch_queue_size > 1:
            raise ValueError("StepTimer times EngineCore.step(); it cannot time async scheduling's overlapping steps.")
        timer = cls()
        scheduler, executor = core.scheduler, core.model_executor
        tap(scheduler, "schedule", before=lambda: timer._mark("start"), after=lambda _: timer._mark("launched"))
        tap(executor, "execute_model", after=timer._on_launched)
        tap(scheduler, "get_grammar_bitmask", after=lambda *_: timer._mark("bitmask_end"))
        tap(executor, "sample_tokens", before=lambda *_, **__: timer._mark("result_end"))
        tap(scheduler, "update_from_output", before=timer._on_update_begin, after=timer._on_step_end)
        return timer

    def _mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter()

    def _on_launched(self, future: Future[Any], *args: object, **kwargs: object) -> None:
        self._forward_clock = CompletionClock(future)

    def _on_update_begin(self, *args: object) -> None:
        now = time.perf_counter()
        # A step that ran no tokens has nothing to sample: its result came at once.
        self._marks.setdefault("result_end", now)
        self._marks["sampled"] = now

    def _on_step_end(self, _: object, scheduler_output: SchedulerOutput, *args: object) -> None:
        self._mark("updated")
        marks, self._marks = self._marks, {}
        clock = self._forward_clock
        marks["forward_end"] = clock.end(marks["result_end"]) if clock is not None else marks["result_end"]
        self.timings.append(StepTiming.from_marks(scheduler_output.total_num_scheduled_tokens, marks))


class CompletionClock:
    """Stamps the moment a future completes, on the thread that completes it.

    So the stamp is the end of the forward pass itself, not the moment the
    engine thread noticed. ``Future`` wakes ``result()`` *before* it runs done
    callbacks, so the stamp may not be there yet when ``result()`` returns;
    ``end`` then falls back to the caller's own clock reading.
    """

    def __init__(self, future: Future[Any]) -> None:
        self._stamp: list[float] = []
        future.add_done_callback(lambda _: self._stamp.append(time.perf_counter()))

    def end(self, fallback: float) -> float:
        return self._stamp[0] if self._stamp else fallback
