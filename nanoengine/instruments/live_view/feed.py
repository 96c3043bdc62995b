"""The live feed: frames of one engine core, kept while a page watches, and the step gate.

Chapters 3-5 and 9, in a browser. ``LiveFeed.attach(core)`` runs in the
engine core's process (the instruments' plugin offers it as the utility calls
``live_view_frames`` and ``live_view_control``): it listens to the step
tracer and, at the end of every step, turns the step into a frame
(``frames.py``). Nothing is attached until a page first asks, and a feed
that nobody has asked for ``IDLE_S`` seconds stops building frames, so a
server with no page open pays nothing per step, and one whose page closed pays
one function call.

``StepGate`` lets a learner pause the engine and advance it one
``EngineCore.step()`` at a time. It wraps the core's ``step_fn`` (the one
call both the in-process client and the core process's busy loop make per
turn) from outside: while paused, a turn sleeps a moment and returns no
outputs without stepping, so the busy loop still reads its sockets (the
"step" and "resume" clicks arrive that way). A pause ends by itself after
``max_pause_s``: an engine left paused by a closed tab must not hang its
clients forever.

vLLM 0.32 counterpart: none. vLLM's nearest is ``pause_generation`` /
``resume_generation`` of ``AsyncLLM`` (which drain or abort, and cannot
single-step) and its KV cache events publisher (``vllm/distributed/kv_events.py``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nanoengine.engine import EngineCoreOutputs
from nanoengine.instruments.live_view.frames import TRACE_VERSION, build_frame
from nanoengine.instruments.trace import StepTrace, TraceRecorder, trace_of

if TYPE_CHECKING:
    from nanoengine.engine.core import EngineCore

logger = logging.getLogger(__name__)

# Frames kept for a page that connects late or falls behind (oldest dropped first).
MAX_FRAMES = 2000
# A feed nobody read for this long stops building frames until the next read.
IDLE_S = 10.0
# How long a paused turn sleeps before the busy loop looks at its sockets again.
PAUSED_TURN_S = 0.02
# A pause with no click for this long resumes the engine by itself.
MAX_PAUSE_S = 300.0
# The control actions a page may send.
ACTIONS = ("pause", "resume", "step")


class StepGate:
    """Pause, resume and single-step an engine core by wrapping its ``step_fn``."""

    def __init__(self, core: EngineCore, max_pause_s: float = MAX_PAUSE_S) -> None:
        self.max_pause_s = max_pause_s
        self.paused = False
        self.credits = 0  # steps the learner asked for while paused
        self.steps_taken = 0  # step_fn calls that ran, paused or not
        self._last_click = time.monotonic()
        self._lock = threading.Lock()  # the page's thread clicks, the engine's thread steps
        self._step_fn: Callable[[], tuple[EngineCoreOutputs, bool]] = core.step_fn
        core.step_fn = self._gated_step

    def control(self, action: str) -> dict[str, Any]:
        """Apply one click; the gate's state after it."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}: expected one of {', '.join(ACTIONS)}")
        with self._lock:
            self._last_click = time.monotonic()
            if action == "pause":
                self.paused = True
            elif action == "resume":
                self.paused, self.credits = False, 0
            elif self.paused:  # "step": one more turn may run
                self.credits += 1
        return self.state()

    def state(self) -> dict[str, Any]:
        return {"paused": self.paused, "credits": self.credits, "steps_taken": self.steps_taken}

    def _may_step(self) -> bool:
        with self._lock:
            if self.paused and time.monotonic() - self._last_click > self.max_pause_s:
                logger.warning("live view: paused for %.0f s with no click; resuming the engine.", self.max_pause_s)
                self.paused, self.credits = False, 0
            if not self.paused:
                return True
            if self.credits:
                self.credits -= 1
                return True
            return False

    def _gated_step(self) -> tuple[EngineCoreOutputs, bool]:
        if not self._may_step():
            time.sleep(PAUSED_TURN_S)
            return EngineCoreOutputs(), False
        self.steps_taken += 1
        return self._step_fn()


class LiveFeed:
    """Frames of one core, built at each step's end while somebody reads them."""

    def __init__(self, core: EngineCore, idle_s: float = IDLE_S) -> None:
        self.core = core
        self.idle_s = idle_s  # math.inf: build frames whether or not anybody reads them
        self.frames: deque[dict[str, Any]] = deque(maxlen=MAX_FRAMES)
        self.started_at = time.monotonic()
        self.last_read = self.started_at
        self.finished_so_far: Counter[str] = Counter()
        self.gate: StepGate | None = None
        # The tracer llm.trace reads, when the engine was built with trace=True;
        # else one of our own, whose steps we drop once they are frames.
        shared = trace_of(core)
        self._keeps_steps = shared is not None
        trace = shared if shared is not None else TraceRecorder.attach(core.scheduler).trace
        self._trace = trace
        trace.listeners.append(self._on_step)

    @property
    def active(self) -> bool:
        return time.monotonic() - self.last_read < self.idle_s

    def stop(self) -> None:
        """Build no more frames (the ones kept stay readable)."""
        self.idle_s = -math.inf

    def frames_after(self, step: int) -> list[dict[str, Any]]:
        """Frames of the steps after ``step`` (all kept ones for -1); reading keeps the feed on."""
        self.last_read = time.monotonic()
        return [frame for frame in list(self.frames) if frame["step"] > step]

    def describe(self) -> dict[str, Any]:
        """What the page needs once: the pool's shape and the trace version."""
        config = self.core.engine_config
        return {
            "version": TRACE_VERSION,
            "model": config.model_config.model,
            "num_blocks": self.core.kv_cache_config.num_blocks,
            "block_size": self.core.kv_cache_config.block_size,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "speculative": config.speculative_config is not None,
        }

    def control(self, action: str) -> dict[str, Any]:
        """Pause / resume / step; the gate is put on at the first click."""
        if self.gate is None:
            self.gate = StepGate(self.core)
        return self.gate.control(action)

    def gate_state(self) -> dict[str, Any]:
        return {"paused": False, "credits": 0, "steps_taken": 0} if self.gate is None else self.gate.state()

    def _on_step(self, step: StepTrace) -> None:
        self.finished_so_far.update(step.finished.values())
        if self.active:
            self.frames.append(build_frame(self.core.scheduler, step, self.finished_so_far, self.started_at))
        if not self._keeps_steps:
            self._trace.steps.clear()
