"""Integer arithmetic the whole engine shares: ``cdiv``.

Chapter 4 (KV cache manager) meets it first: a request of ``n`` tokens needs
``cdiv(n, block_size)`` blocks, because a partly filled last block is still a
whole block. Chapter 6 sizes the KV cache with it, and the worker (chapter 7)
sizes its block tables with it.
vLLM 0.32 counterpart: ``vllm/utils/math_utils.py`` (``cdiv``).

Pure Python on purpose: ``nanoengine/core`` imports it and must stay free of
torch and numpy, so this module imports nothing.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed to hold ``a`` tokens in blocks of ``b``."""
    return -(-a // b)
