"""The step tracer: see every scheduling and KV cache decision of a run.

Chapters 3 (scheduler) and 4 (KV cache manager). Turn it on with
``LLM(..., trace=True)`` or ``NANOENGINE_TRACE=1``; after (or while)
generating, ``llm.trace`` is an ``EngineTrace`` with one ``StepTrace`` per step.
``trace_table(llm.trace)`` renders it with rich, ``save_timeline(llm.trace, path)``
draws a per-request timeline with KV usage beneath (needs the ``plot`` extra).
With speculative decoding (chapter 9) each step also records, per request,
the draft tokens verified and how many were accepted or rejected.

Modules: ``data`` (the dataclasses), ``recorder`` (watches the scheduler from
outside; nothing is watched when tracing is off), ``table`` (rich),
``timeline`` (matplotlib, imported only when a picture is drawn). The data
knows nothing of the two renderers; they read it.

vLLM 0.32 counterpart: none; vLLM reports aggregate metrics
(``vllm/v1/metrics/stats.py``) rather than a per-step trace.
"""

from nanoengine.instruments.trace.data import (
    EngineTrace,
    Preemption,
    RequestTimeline,
    ScheduledChunk,
    Segment,
    StepTrace,
)
from nanoengine.instruments.trace.recorder import TraceRecorder, record_steps_of, trace_of
from nanoengine.instruments.trace.table import trace_table
from nanoengine.instruments.trace.timeline import save_timeline

__all__ = [
    "EngineTrace",
    "Preemption",
    "RequestTimeline",
    "ScheduledChunk",
    "Segment",
    "StepTrace",
    "TraceRecorder",
    "record_steps_of",
    "save_timeline",
    "trace_of",
    "trace_table",
]

