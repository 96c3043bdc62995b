"""The step tracer: see every scheduling and KV cache decision of a run.

Chapters 3 (scheduler) and 4 (KV cache manager). Turn it on with
``LLM(..., trace=True)`` or ``NANOENGINE_TRACE=1``; after (or while)
generating, ``llm.trace`` is an ``EngineTrace`` with one ``StepTrace`` per step.
``llm.trace.to_table()`` renders it with rich, ``llm.trace.save_timeline(path)``
draws a per-request timeline with KV usage beneath (needs the ``plot`` extra).

Modules: ``data`` (the dataclasses), ``recorder`` (watches the scheduler from
outside; nothing is watched when tracing is off), ``table`` (rich),
``timeline`` (matplotlib).

vLLM 0.32 counterpart: none; vLLM reports aggregate metrics
(``vllm/v1/metrics/stats.py``) rather than a per-step trace.
"""

from nanoengine.trace.data import EngineTrace, Preemption, RequestTimeline, ScheduledChunk, Segment, StepTrace
from nanoengine.trace.recorder import TraceRecorder

__all__ = [
    "EngineTrace",
    "Preemption",
    "RequestTimeline",
    "ScheduledChunk",
    "Segment",
    "StepTrace",
    "TraceRecorder",
]
