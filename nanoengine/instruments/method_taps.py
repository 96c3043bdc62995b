"""Method taps: watch one object's method calls from outside the method.

Chapters 3-5 and 7. The step tracer (chapters 3-4), the step timer (chapter 5),
the invariant checker and the chapter-7 walkthrough all need to see the engine
at a few moments: a request preempted, a block evicted, a step scheduled, a
forward pass launched. Writing those calls into ``Scheduler.schedule()`` or
``EngineCore.step()`` would bury the algorithm a chapter is about under its
instruments. Instead an observer *taps* a method of one live object::

    tap(scheduler, "schedule", after=lambda output: print(output.num_scheduled_tokens))

``tap`` stores, on that one instance, a wrapper that calls ``before(*args)``,
then the original method, then ``after(result, *args)``. Python looks up
``self.schedule`` on the instance before the class, so the scheduler's own
calls go through the wrapper too. The class is unchanged, other instances are
unchanged, and an engine that nobody observes runs the plain methods.

The idea is that of ``unittest.mock.patch.object(obj, name, wraps=...)``.
vLLM 0.32 counterpart: none; vLLM times phases with ``torch.profiler``
record functions and reports what happened through ``SchedulerStats`` and
per-request ``EngineCoreEvent`` timestamps.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any


def tap(
    obj: object,
    name: str,
    *,
    before: Callable[..., object] | None = None,
    after: Callable[..., object] | None = None,
) -> None:
    """Call ``before(*args, **kwargs)`` and ``after(result, *args, **kwargs)`` around ``obj.name``.

    The observers receive the call's own arguments (without ``self``); what
    they return is ignored. Tapping the same method twice nests the wrappers,
    so several observers can watch one method.
    """
    if before is None and after is None:
        raise ValueError(f"tap({type(obj).__name__}.{name}) needs a before or an after observer.")
    original = getattr(obj, name)
    if not callable(original):
        raise TypeError(f"{type(obj).__name__}.{name} is not a method, cannot tap it.")

    @functools.wraps(original)
    def tapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    setattr(obj, name, tapped)


def time_calls(obj: object, names: Iterable[str], seconds: dict[str, float]) -> None:
    """Tap each method ``names`` of ``obj`` so that ``seconds[name]`` holds its last call's duration.

    Entries appear in the order the calls happen.
    """
    for name in names:
        _time_one(obj, name, seconds)


def _time_one(obj: object, name: str, seconds: dict[str, float]) -> None:
    started: list[float] = []  # a stack, so a call that re-enters itself still pairs up

    def begin(*_: object, **__: object) -> None:
        started.append(time.perf_counter())

    def end(*_: object, **__: object) -> None:
        seconds[name] = time.perf_counter() - started.pop()

    tap(obj, name, before=begin, after=end)


@contextlib.contextmanager
def time_class_calls(cls: type, labels: Mapping[str, str]) -> Iterator[dict[str, float]]:
    """While the block runs, every call of ``cls.<name>`` (for each name of ``labels``),
    on any instance, leaves its duration in the yielded dict under ``labels[name]``.

    The class's own methods come back when the block ends. For objects built
    inside the block, whose construction one wants to time: no instance exists
    yet to ``tap``. Chapter 6 times ``LLM(...)``'s construction steps this way.
    """
    seconds: dict[str, float] = {}
    originals = {name: cls.__dict__[name] for name in labels}

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[labels[name]] = time.perf_counter() - start

        return wrapper

    for name, method in originals.items():
        setattr(cls, name, timed(name, method))
    try:
        yield seconds
    finally:
        for name, method in originals.items():
            setattr(cls, name, method)
