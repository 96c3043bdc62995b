"""The running CPU, read at run time: its vector instructions, the kernel build
they select, its bf16 hardware, and the dtype ``"auto"`` picks from it.

Chapter 7 (one kernel build per instruction set; bf16 on a CPU: which
instructions make it fast) and chapter 6 (``dtype="auto"``). vLLM 0.32
counterpart: ``vllm/platforms/cpu.py`` (``CpuPlatform.supported_dtypes``, and
``import_kernels``, which picks ``_C`` or ``_C_AVX2``) with
``_resolve_auto_dtype`` in ``vllm/config/model.py``.

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
import os
import platform
from pathlib import Path
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
    """Ask the running CPU (through torch's cpuinfo) which bf16 instructions it has.

    Both are AVX-512-era instructions: a process capped at the AVX2 kernel
    variant (``NANOENGINE_CPU_ISA=avx2``) behaves as an AVX2-only CPU and sees neither.
    """
    if kernel_isa() != "avx512":
        return CpuBf16Features(avx512_bf16=False, amx_bf16=False)
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


# ---- the kernel build's instruction set ------------------------------------
# [anchor: kernel-isa]
# vLLM ships one kernel library per instruction set (``_C_AVX2``, ``_C_AVX512``,
# ``_C`` for avx512_bf16/AMX) and imports the one the CPU can run
# (``vllm/platforms/cpu.py``, ``import_kernels``). nanoengine compiles its
# kernels on the learner's machine, so it builds one *variant* per instruction
# set from the same sources instead, and picks the widest the CPU has. The
# sources size their vectors and register tiles from the variant
# (``csrc/cpu/ops.h``: kLanes, kTileRows): AVX-512 has 32 registers of 16
# floats, AVX2 16 registers of 8 (ARM's NEON 32 of 4), and code sized for the
# first runs many times slower on the second (chapter 7 tells how much).
CPU_ISA_ENV = "NANOENGINE_CPU_ISA"
# Variant -> compiler flags, widest vectors first. "avx512" takes the CPU's own
# flags (-march=native), so avx512_bf16 and AMX come with it where present;
# "avx2" is x86-64-v3 (AVX2, FMA, F16C: every x86 CPU since about 2015) tuned
# for this CPU; "generic" is whatever the compiler makes of this CPU elsewhere
# (an ARM laptop: plain vector extensions, no x86 intrinsics).
KERNEL_ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("-march=native",),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "generic": (
        ("-mcpu=native",) if platform.machine().lower() in ("aarch64", "arm64") else ("-march=native",)
    ),
}
# The same cap for the libraries under torch, so a capped run is AVX2 end to end:
# ATen's own vector kernels, oneDNN (linear_backend="onednn") and MKL (F.linear).
# Each is read once, when its library starts, so they must be in the environment
# of a process before it imports torch (scripts/bench.py sets them per child).
_LIBRARY_CAPS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def supported_kernel_isas() -> tuple[str, ...]:
    """The kernel variants this CPU can run, widest first; "generic" always last."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
    found = []
    if x86 and torch.cpu._is_avx512_supported():
        found.append("avx512")
    if x86 and torch.cpu._is_avx2_supported():
        found.append("avx2")
    return (*found, "generic")


@functools.cache
def kernel_isa() -> str:
    """The variant this process builds and runs: the widest, or the cap in NANOENGINE_CPU_ISA.

    ``NANOENGINE_CPU_ISA=avx2`` on an AVX-512 machine runs the AVX2 variant, so
    the AVX2 path can be measured (and tested) on any x86 machine.
    """
    requested = os.environ.get(CPU_ISA_ENV, "auto").strip().lower() or "auto"
    supported = supported_kernel_isas()
    if requested == "auto":
        return supported[0]
    if requested not in KERNEL_ISA_FLAGS:
        choices = ", ".join(KERNEL_ISA_FLAGS)
        raise ValueError(f"{CPU_ISA_ENV}={requested!r}: expected auto or one of {choices}.")
    if requested not in supported:
        raise ValueError(
            f"{CPU_ISA_ENV}={requested!r}: this CPU ({platform.processor() or platform.machine()}) "
            f"runs only {', '.join(supported)}."
        )
    return requested


def isa_cap_environment(isa: str) -> dict[str, str]:
    """Environment variables that cap a new process (nanoengine and torch's libraries) at ``isa``."""
    return {CPU_ISA_ENV: isa, **_LIBRARY_CAPS.get(isa, {})}


def cpuinfo_line(*prefixes: str) -> str | None:
    """What follows the colon on the first ``/proc/cpuinfo`` line starting with one of
    ``prefixes`` (Linux; None elsewhere, or where no line has them)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith(prefixes):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> tuple[str, ...]:
    """The vector-unit flags of the running CPU (x86 "flags", ARM "Features"), for the record of a figure."""
    interesting = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
                   "asimd", "sve")
    present = set((cpuinfo_line("flags", "Features") or "").split())
    return tuple(flag for flag in interesting if flag in present)


def cpu_model_name() -> str:
    """The CPU's model name as Linux reports it (else what Python's platform module knows)."""
    return cpuinfo_line("model name") or platform.processor() or platform.machine()
# [/anchor: kernel-isa]


def describe_cpu() -> str:
    """One line naming the CPU a figure was measured on: model, cores, vector flags, ATen's level."""
    flags = " ".join(cpu_flags()) or "unknown"
    aten = torch.backends.cpu.get_cpu_capability()
    return f"CPU: {cpu_model_name()} ({os.cpu_count()} cores); flags: {flags}; ATen {aten}"
