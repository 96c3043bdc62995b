"""StepTiming: where the wall time of one ``EngineCore.step()`` went.

Chapter 5 (engine skeleton) uses it to show the point of
``execute_model(..., non_block=True)``: the forward pass runs on the forward
thread while the engine thread builds the grammar bitmask, and only then waits
in ``future.result()``. Six ``time.perf_counter()`` reads per step, kept for
the last step only, so it is always on.
vLLM 0.32 counterpart: none as a record; ``EngineCore.step`` in
``vllm/v1/engine/core.py`` has the same overlap, measured there with profilers.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


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

    @property
    def total_s(self) -> float:
        return (
            self.schedule_s
            + max(self.forward_s, self.bitmask_s + self.wait_s)
            + self.sample_s
            + self.update_s
        )

    @classmethod
    def from_marks(
        cls,
        num_scheduled_tokens: int,
        start: float,
        launched: float,
        forward_end: float,
        bitmask_end: float,
        result_end: float,
        sampled: float,
        updated: float,
    ) -> StepTiming:
        return cls(
            num_scheduled_tokens=num_scheduled_tokens,
            schedule_s=launched - start,
            forward_s=forward_end - launched,
            bitmask_s=bitmask_end - launched,
            wait_s=result_end - bitmask_end,
            sample_s=sampled - result_end,
            update_s=updated - sampled,
            overlap_s=max(min(bitmask_end, forward_end) - launched, 0.0),
        )


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
