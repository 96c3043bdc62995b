"""Memory sizes as people read them: ``format_bytes``.

Chapter 6 (``LLM(...)`` construction) prints the memory it profiled and the KV
cache it sized: the memory report, the construction table and the error for a
budget too small for one request all write their sizes with ``format_bytes``.
vLLM 0.32 counterpart: ``vllm/utils/mem_utils.py`` (``format_gib``, which always
prints GiB; nanoengine picks the unit, since a test engine's budget is a few MiB).

vLLM's module also holds the torch memory profiling; nanoengine's lives in
``nanoengine/worker/memory_probe.py``, so this module imports nothing and
``nanoengine/core`` (``kv_cache_sizing``'s error message) may use it.
"""

from __future__ import annotations


def format_bytes(num_bytes: int) -> str:
    """Human-sized units, so a tiny test budget does not read as "0.000 GiB"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"
