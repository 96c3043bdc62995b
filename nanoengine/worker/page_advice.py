"""Keep the CPU KV cache on ordinary 4 KiB pages, so first writes never stall.

Chapter 6 (where the KV cache's memory comes from). vLLM 0.32 counterpart:
none; vLLM's CPU worker allocates its cache with ``torch.empty`` and leaves
page sizes to the system.

The CPU KV cache is allocated lazily: its zeros come from ``calloc`` (through
numpy), so the kernel maps a page only when a block is first written, in the
middle of some decode step. numpy asks Linux for *transparent huge pages* on
every large array (``madvise(MADV_HUGEPAGE)``), and then such a first write
makes the kernel find, zero and map a whole 2 MiB page -- compacting memory
first if none is free. Measured here at a batch of 64: single K/V writes of
~5 ms, ~10 ms of every step. Opting the cache out (``MADV_NOHUGEPAGE``) keeps
first writes to 4 KiB faults of a few microseconds: the same step wrote its K/V
in ~1.5 ms. ``madvise`` only advises: off Linux nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

import torch

PAGE_BYTES = 4096
MADV_NOHUGEPAGE = 15  # from <sys/mman.h>, Linux


@functools.cache
def _madvise() -> Any:
    """libc's madvise as a ctypes function, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    function = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def advise_no_huge_pages(tensor: torch.Tensor) -> bool:
    """MADV_NOHUGEPAGE on the whole pages inside ``tensor``'s memory.

    Call it before the memory is first written. Returns whether the kernel
    accepted the advice (False off Linux, off the CPU, or when refused).
    """
    madvise = _madvise()
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned = -(-start // PAGE_BYTES) * PAGE_BYTES  # madvise wants a page-aligned start
    if madvise is None or tensor.device.type != "cpu" or end <= aligned:
        return False
    return bool(madvise(aligned, end - aligned, MADV_NOHUGEPAGE) == 0)
