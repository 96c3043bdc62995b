"""The teaching instruments: what lets a learner watch the engine work, kept apart from it.

Chapters 3-8. Every instrument here observes a live engine from outside; no
engine class builds, stores or calls one, and an architecture test
(``tests/test_architecture.py``) keeps it so. They reach the engine three ways:

* the ``LLM`` facade and the walkthroughs (``chapters/``) call them on the
  objects they hold (``print(llm)``, ``memory_report_of(core)``, ``StepTimer.attach``);
* ``method_taps`` wraps one object's method (or, for construction, one class's)
  so the engine's own code stays free of timing and tracing calls;
* ``plugin`` is named in the package metadata as an engine core plugin
  (``nanoengine/plugins/``): every ``EngineCore`` calls it, in whatever process
  the core lives, and it attaches what the configuration asks for.

Modules: ``trace/`` (the step tracer, chapters 3-4), ``invariants`` (the
bookkeeping checks, chapters 3-4), ``component_tree`` and ``source_locations``
(the source map, chapter 5), ``step_timing`` (step and construction timers,
chapters 5-6), ``memory_report`` (chapter 6), ``tp_inspection`` (tensor
parallelism, chapter 6), ``method_taps`` and ``plugin`` (how they attach).
The package stays empty: importing one instrument pays for that one only.

vLLM 0.32 counterpart: none; vLLM observes itself through metrics, logs and
profilers (``vllm/v1/metrics/``), with no teaching instruments.
"""
