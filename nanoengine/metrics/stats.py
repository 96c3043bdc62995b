"""SchedulerStats and PrefixCacheStats: plain counters, no torch.

Chapter 2 plots ``SchedulerStats`` step by step; chapter 4's prefix cache keeps
``PrefixCacheStats``; chapter 8's ``/metrics`` serves both.
vLLM 0.32 counterpart: ``vllm/v1/metrics/stats.py`` (``SchedulerStats``,
``PrefixCacheStats``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (``hits / queries`` = hit rate).

    Every lookup counts, including the retry of a request whose allocation
    failed in an earlier step, as in vLLM.
    """

    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for loggers and metrics (chapter 2 plots these per step).

    In vLLM it travels to the front end inside ``EngineCoreOutputs``; here the
    server's ``/metrics`` asks for it (``get_stats``, chapter 8).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks in use, 0.0 to 1.0
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int  # cumulative
