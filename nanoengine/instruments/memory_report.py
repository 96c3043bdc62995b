"""The memory breakdown of chapter 6, and the batch-size bound it implies (chapter 2).

After ``LLM(...)`` has profiled the model and sized the KV cache, this report
puts the pieces side by side: weights, peak activations of the profiling pass,
memory outside torch, CUDA graphs, and the KV cache that remains -- then what
the KV cache buys: blocks, tokens, and how many ``max_model_len`` requests fit
at once. ``memory_report_of(core)`` builds it from a live in-process
``EngineCore`` (its executor's ``memory_profile`` and its ``kv_cache_config``);
``python -m chapters.ch06_construction`` prints it. The engine itself logs
only vLLM's two plain start-up lines (``EngineCore._log_kv_cache_size``).
vLLM 0.32 counterpart: the start-up log lines of ``vllm/v1/worker/gpu_worker.py``
(``determine_available_memory``: "Memory profiling takes ... model weights took
... the rest of the memory reserved for KV Cache is ...") and
``vllm/v1/core/kv_cache_utils.py`` ("GPU KV cache size: ... tokens; Maximum
concurrency for ... tokens per request: ...x").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.table import Table

from nanoengine.core.kv_cache_sizing import max_concurrency, token_capacity
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.utils.mem_utils import format_bytes
from nanoengine.worker.worker import MemoryProfile

if TYPE_CHECKING:
    from nanoengine.engine.core import EngineCore


@dataclass
class MemoryReport:
    """The profile, the KV cache it paid for, and the request length it is judged by."""

    profile: MemoryProfile
    kv_cache_config: KVCacheConfig
    max_model_len: int

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_config.num_blocks

    @property
    def token_capacity(self) -> int:
        return token_capacity(self.kv_cache_config)

    @property
    def max_concurrency(self) -> float:
        return max_concurrency(self.kv_cache_config, self.max_model_len)

    def rows(self) -> list[tuple[str, str, str]]:
        """(item, size, how it was obtained), in the order chapter 6 tells them."""
        profile = self.profile
        rows = [
            ("model weights", format_bytes(profile.weights_bytes), "sum of parameter sizes"),
            ("peak activations", format_bytes(profile.peak_activation_bytes), profile.activation_method),
        ]
        if profile.device == "cuda":
            rows += [
                ("non-torch memory", format_bytes(profile.non_torch_bytes), "used on the GPU outside torch"),
                ("CUDA graphs", format_bytes(profile.cudagraph_bytes), "reserved memory grown by capture"),
            ]
        rows += [
            (
                "KV cache",
                format_bytes(self.kv_cache_config.total_bytes),
                f"what remains ({profile.budget_source})",
            ),
            ("engine budget", format_bytes(profile.total_budget_bytes), "the sum the knobs allow"),
            (
                "KV blocks",
                str(self.num_blocks),
                f"{self.kv_cache_config.block_size} tokens each, incl. null block",
            ),
            ("token capacity", str(self.token_capacity), "tokens of KV the cache can hold"),
            (
                "max concurrency",
                f"{self.max_concurrency:.2f}x",
                f"requests of max_model_len={self.max_model_len} at once",
            ),
        ]
        return rows


def memory_report_of(core: EngineCore) -> MemoryReport | None:
    """The report of a built engine core; None when its executor kept no profile."""
    profile = core.model_executor.memory_profile
    if profile is None:
        return None
    return MemoryReport(profile, core.kv_cache_config, core.engine_config.model_config.max_model_len)


def memory_table(report: MemoryReport) -> Table:
    """The report as a rich table."""
    table = Table(
        title=f"Memory profile ({report.profile.device}, profiling pass {report.profile.profile_seconds:.2f} s)"
    )
    table.add_column("item")
    table.add_column("size", justify="right")
    table.add_column("how")
    for row in report.rows():
        table.add_row(*row)
    return table
