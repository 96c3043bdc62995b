"""The CPU's bf16 hardware, read at run time, and the dtype ``"auto"`` picks from it.

Chapter 7 (bf16 on a CPU: which instructions make it fast) and chapter 6
(``dtype="auto"``). vLLM 0.32 counterpart: ``vllm/platforms/cpu.py``
(``CpuPlatform.supported_dtypes``) with ``_resolve_auto_dtype`` in
``vllm/config/model.py``.

vLLM's rule on an x86 CPU: ``dtype="auto"`` takes the checkpoint's dtype (bf16
for SmolLM2), and downcasts an fp32 checkpoint to bf16, on *every* x86 CPU.
nanoengine narrows it to where bf16 is fast: bf16 when the CPU has bf16 dot
products (``avx512_bf16``, or AMX's ``amx_bf16``), fp32 elsewhere. Without them a
bf16 matmul converts every number to fp32 first, and runs slower than fp32.
The flags are read from the running CPU (torch asks the ``cpuid`` instruction),
never assumed from the machine a build or a note was made on.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)


class CpuBf16Features(NamedTuple):
    """The bf16 instruction families of the running CPU."""

    avx512_bf16: bool  # VDPBF16PS: 16 fp32 sums of bf16 pairs per instruction
    amx_bf16: bool  # AMX tiles: a 16x32 by 32x16 bf16 tile product per instruction

    @property
    def fast_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx_bf16

    def describe(self) -> str:
        names = [name for name, present in self._asdict().items() if present]
        return ", ".join(names) if names else "no bf16 dot-product instructions"


@functools.cache
def cpu_bf16_features() -> CpuBf16Features:
    """Ask the running CPU (through torch's cpuinfo) which bf16 instructions it has."""
    cpu = torch.cpu
    avx512_bf16 = bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())
    amx = bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return CpuBf16Features(avx512_bf16=avx512_bf16, amx_bf16=amx)


def default_cpu_dtype() -> str:
    """``dtype="auto"`` on a CPU: "bfloat16" where bf16 is fast, else "float32"."""
    return "bfloat16" if cpu_bf16_features().fast_bf16 else "float32"


@functools.cache
def warn_slow_bf16_once() -> None:
    """Say once, in the log, that bf16 was asked for on a CPU without fast bf16."""
    logger.warning(
        "This CPU has %s: bf16 matmuls run through oneDNN where it can, else F.linear, slower than fp32 here. "
        "dtype='auto' would pick float32.",
        cpu_bf16_features().describe(),
    )
