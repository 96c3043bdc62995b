"""The machine's matmul roofline (fp32 and bf16), its memory bandwidth, and a model's share (chapter 2).

Used by ``python -m chapters.ch02_batching`` and by ``scripts/bench.py``.

Chapter 2 asks whether decode is memory-bound or compute-bound. On this kind of
CPU the answer comes from two numbers: what one large GEMM reaches (the best
this machine does on a model's main operation, in GFLOP/s) and how many FLOPs a
generated token costs (2 per weight of every matmul the token passes through,
plus attention's 4 * layers * hidden per cached token). Model FLOP/s achieved
divided by the GEMM figure is the "roofline share" bench.py prints. The GEMM is
measured through every path available: ``torch.mm``, a oneDNN-prepacked weight
(vLLM's CPU path) and nanoengine's own packed GEMM (what its CPU linear layers
take, ``csrc/cpu/gemm.cpp``, and in bf16 each kernel of ``gemm_bf16.cpp``);
the fastest sets the roofline. A bf16 model's share is taken against the bf16
roofline: bf16 dot products do twice the multiplies of fp32 per instruction
(AMX tiles many more), so its peak is a different number.
vLLM 0.32 counterpart: none in the engine; ``vllm/benchmarks`` reports only tok/s.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from nanoengine.model_executor.layers.cpu_linear import (
    bf16_gemm_kernels,
    cpu_gemm_usable,
    cpu_linear,
    onednn_linear,
    onednn_supports,
    pack_cpu_weight,
    pack_weight,
)

_T = TypeVar("_T")


@dataclass(frozen=True)
class Roofline:
    dtype: str  # "float32" or "bfloat16": the element type of every product measured
    size: int  # the square GEMM size it was measured on
    threads: int
    # GFLOP/s by path: "torch.mm" (what F.linear and HF transformers take),
    # "oneDNN prepacked" (vLLM's CPU path), "nanoengine GEMM" (csrc/cpu/gemm.cpp)
    # or, in bf16, one "nanoengine GEMM (<kernel>)" per kernel of gemm_bf16.cpp.
    path_gflops: dict[str, float]

    @property
    def gflops(self) -> float:
        """The roofline: the fastest path. A share of a slower one would flatter the engine."""
        return max(self.path_gflops.values())

    def paths(self) -> dict[str, float]:
        """Every path measured here, by name."""
        return dict(self.path_gflops)

    @property
    def best_path(self) -> str:
        return max(self.path_gflops.items(), key=lambda item: item[1])[0]


def _best_gflops(matmul: Callable[[], object], size: int, repeats: int) -> float:
    matmul()  # first call: thread pool start-up, page faults, oneDNN's kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def _on_a_thread_of_its_own(measure: Callable[[], _T]) -> _T:
    """Run ``measure`` on a short-lived thread and return its result.

    torch's OpenMP runtime keeps a pool of worker threads for every thread that
    runs parallel work, until that thread exits. Measured on the caller's
    thread, the GEMMs would leave a second pool behind in a process that then
    builds an engine (whose forward thread has its own), and with more OpenMP
    threads than cores GNU OpenMP throttles its idle workers' spinning: the
    engine ran ~20% slower (chapter 7). A thread that exits takes its pool along.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(measure).result()


def measure_gemm_roofline(size: int = 2048, repeats: int = 5, dtype: str = "float32") -> Roofline:
    """Best of ``repeats`` [size x size] @ [size x size] products in ``dtype``, in GFLOP/s.

    Every matmul path available is measured and the fastest is the roofline: a
    share of a slower one would flatter the engine.
    """
    return _on_a_thread_of_its_own(lambda: _measure_gemm_roofline(size, repeats, getattr(torch, dtype)))


def _measure_gemm_roofline(size: int, repeats: int, dtype: torch.dtype) -> Roofline:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    paths = {"torch.mm": _best_gflops(lambda: torch.mm(a, b), size, repeats)}
    weight = b.t().contiguous()  # the packed paths compute a @ W^T = a @ b
    if onednn_supports(dtype):
        packed = pack_weight(weight)
        paths["oneDNN prepacked"] = _best_gflops(lambda: onednn_linear(a, packed, None), size, repeats)
    device = torch.device("cpu")
    if cpu_gemm_usable(device, dtype):
        panels = pack_cpu_weight(weight)
        if dtype == torch.bfloat16:
            for kernel in bf16_gemm_kernels():
                paths[f"nanoengine GEMM ({kernel})"] = _best_gflops(
                    functools.partial(cpu_linear, a, panels, None, size, kernel), size, repeats
                )
        else:
            paths["nanoengine GEMM"] = _best_gflops(lambda: cpu_linear(a, panels, None, size), size, repeats)
    return Roofline(str(dtype).removeprefix("torch."), size, torch.get_num_threads(), paths)


def describe_matmul_paths(roofline: Roofline) -> str:
    """ "torch.mm 207 GFLOP/s, oneDNN prepacked 466 GFLOP/s, ...": every path, one line."""
    return ", ".join(f"{name} {gflops:.0f} GFLOP/s" for name, gflops in roofline.paths().items())


def measure_memory_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best copy bandwidth in GB/s (bytes read + bytes written), a decode step's other limit."""
    return _on_a_thread_of_its_own(lambda: _measure_memory_bandwidth(num_bytes, repeats))


def _measure_memory_bandwidth(num_bytes: int, repeats: int) -> float:
    source = torch.ones(num_bytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best / 1e9


def matmul_flops_per_token(hf_config: Any) -> float:
    """2 x (weights of every per-token matmul): q/k/v/o, gate/up/down, LM head."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = int(hf_config.intermediate_size)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    return 2.0 * (int(hf_config.num_hidden_layers) * per_layer + hidden * int(hf_config.vocab_size))


def attention_flops(hf_config: Any, context_len: float) -> float:
    """QK^T and PV for one query token over ``context_len`` cached tokens."""
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads)
    return 4.0 * int(hf_config.num_hidden_layers) * heads * head_dim * context_len


def workload_flops(hf_config: Any, prompts: list[list[int]], max_tokens: list[int]) -> float:
    """FLOPs of one whole workload: every prompt token and every generated token.

    A generated token at position p attends to p tokens; the mean context of a
    request is its prompt plus half its output.
    """
    per_token = matmul_flops_per_token(hf_config)
    total = 0.0
    for prompt, new in zip(prompts, max_tokens):
        tokens = len(prompt) + new
        total += tokens * per_token + tokens * attention_flops(hf_config, tokens / 2)
    return total


def median_or_dash(values: list[float], scale: float = 1000.0) -> str:
    """A median in milliseconds, or "-" when the system reports none."""
    if not values:
        return "-"
    ordered = sorted(values)
    mid = len(ordered) // 2
    value = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return f"{value * scale:.0f}"


def extras_table(
    rows: list[tuple[str, str, float, float]],
    latencies: dict[tuple[str, str], dict[str, list[float]]],
    roofline: Roofline,
) -> Any:
    """(workload, system, median seconds, workload GFLOP) rows -> a rich Table.

    The share is model FLOP/s (the whole workload, prefill included, over the
    median wall time) divided by the measured GEMM roofline.
    """
    from rich.table import Table

    table = Table(
        title=f"Latency and roofline share ({roofline.dtype} GEMM roofline {roofline.gflops:.1f} GFLOP/s)"
    )
    for column in (
        "workload",
        "system",
        "TTFT median ms",
        "TPOT median ms",
        "model GFLOP/s",
        "roofline share",
    ):
        table.add_column(column, justify="left" if column in ("workload", "system") else "right")
    for workload, system, seconds, gflop in rows:
        achieved = gflop / seconds
        measured = latencies.get((workload, system), {})
        table.add_row(
            workload,
            system,
            median_or_dash(measured.get("ttft", [])),
            median_or_dash(measured.get("tpot", [])),
            f"{achieved:.1f}",
            f"{achieved / roofline.gflops:.0%}",
        )
    table.caption = (
        f"roofline: best of 5 [{roofline.size}x{roofline.size}] {roofline.dtype} matmuls, "
        f"{roofline.threads} threads, "
        f"{roofline.best_path} ({describe_matmul_paths(roofline)})"
    )
    return table
