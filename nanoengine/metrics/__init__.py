"""Counters the engine keeps about itself, for loggers and the server's ``/metrics``.

Chapters 2 (the per-step plots) and 8 (``/metrics``). vLLM 0.32 counterpart:
``vllm/v1/metrics/`` (``stats.py``; its Prometheus side is
``nanoengine/entrypoints/openai/metrics.py`` here).
"""
