"""How much memory the profiling forward pass really needed, on CUDA and on CPU.

Chapter 6 (``determine_available_memory``): the KV cache gets what is left after
the weights *and the peak of a forward pass at full batch*, so that peak must be
measured, not guessed.

* CUDA: torch's caching allocator counts every byte it hands out; resetting its
  peak before the pass and reading ``max_memory_allocated`` after gives the
  pass's peak exactly.
* CPU: torch's CPU allocator keeps no such counter, so the probe asks the
  operating system. Linux records the process's resident-set high-water mark
  (``VmHWM`` in ``/proc/self/status``) and lets a process reset it (write ``5``
  to ``/proc/self/clear_refs``). Reset, run, read: the growth of the high-water
  mark over the resident size before the pass is the pass's peak, counted in
  pages really touched (all of glibc's and torch's scratch included). It is a
  lower bound: scratch memory served from pages the process already had
  resident (freed earlier, kept by glibc) does not raise the mark. Where the
  reset is not allowed, the growth of the lifetime peak is reported instead (an
  underestimate when an earlier phase peaked higher), and the method says so.

vLLM 0.32 counterpart: ``vllm/utils/mem_utils.py`` (``memory_profiling``,
``MemorySnapshot``) for CUDA; vLLM's CPU worker does not measure activations at
all and takes a fixed ``VLLM_CPU_KVCACHE_SPACE`` instead.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

import torch


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), in KiB; None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Set VmHWM back to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class PeakMemoryProbe:
    """``with PeakMemoryProbe(device) as probe: run()`` then ``probe.peak_growth_bytes``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_growth_bytes = 0
        self.method = ""
        self._baseline = 0

    def __enter__(self) -> Self:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated during the pass, above the weights"
            return self
        reset = _reset_peak_rss()
        self._baseline = (_status_kib("VmRSS") or 0) * 1024
        self.method = (
            "peak RSS (VmHWM, reset before the pass) above the RSS before it"
            if reset
            else "lifetime peak RSS above the RSS before the pass (VmHWM could not be reset)"
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = (_status_kib("VmHWM") or 0) * 1024
        self.peak_growth_bytes = max(peak - self._baseline, 0)
