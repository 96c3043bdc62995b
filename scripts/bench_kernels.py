"""Every CPU fast path against its plain torch reference, per kernel variant, in one run.

Chapter 7 ("One kernel build per instruction set") quotes these tables. For
each kernel variant this CPU can run (``avx512`` and ``avx2`` on an AVX-512
machine, ``avx2`` alone on an AVX2 one), a child process capped at that
variant (``NANOENGINE_CPU_ISA`` and the caps of torch's own libraries,
``nanoengine.platforms.cpu.isa_cap_environment``) times, at SmolLM2-135M's shapes:

* prefill attention of one prompt of 16 .. 2,048 tokens: the C++ kernel
  (``paged_prefill_attention``) against the torch reference backend;
* decode attention of a batch of 1 .. 64 requests with 256 cached tokens each;
* the linear layers (qkv, gate_up, down) at 1 .. 2,048 rows: nanoengine's
  packed GEMM and oneDNN against ``F.linear``;
* the fraction of the machine's measured fp32 matmul peak (chapter 2's
  roofline: the fastest of every matmul path on a 2048^3 product, in the same
  child) that prefill attention reaches.

A fast path slower than its reference at any of these shapes is marked
"SLOWER": that is a defect to fix, or a shape where ``"auto"`` must not pick it.

Usage: ``python scripts/bench_kernels.py [--isa avx2] [--quick] [--json out.json]``
vLLM 0.32 counterpart: none (vLLM's kernel benchmarks live in ``benchmarks/kernels/``,
for GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from chapters.roofline_math import measure_gemm_roofline
from nanoengine.platforms.cpu import cpu_flags, cpu_model_name, isa_cap_environment, supported_kernel_isas

# SmolLM2-135M-Instruct: 9 query heads over 3 KV heads of 64, hidden 576, MLP 1536.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 9, 3, 64, 576, 1536
BLOCK_SIZE = 16
LINEAR_SHAPES = {
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    "gate_up": (HIDDEN, 2 * INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
}


def median_seconds(fn: Callable[[], object], budget_s: float, max_repeats: int = 25) -> float:
    """The median wall time of ``fn`` after one warm-up call, repeated within ``budget_s``."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (len(times) < max_repeats and time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paged_batch(seq_lens: list[int], query_lens: list[int], num_decodes: int) -> tuple[Any, torch.Tensor]:
    """An AttentionMetadata and a filled, shuffled KV cache for requests of ``seq_lens`` keys."""
    from nanoengine.attention.backends.abstract import AttentionMetadata

    blocks_each = [-(-n // BLOCK_SIZE) for n in seq_lens]
    total_blocks = sum(blocks_each)
    order = torch.randperm(total_blocks, dtype=torch.int32)  # blocks lie anywhere in the cache
    table = torch.zeros(len(seq_lens), max(blocks_each), dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks_each):
        table[i, :count] = order[start : start + count]
        start += count
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    md = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        num_reqs=len(seq_lens),
        num_decodes=num_decodes,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    cache = torch.randn(2, total_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return md, cache


def time_prefill(prompt_len: int, budget_s: float) -> dict[str, float]:
    """Seconds for one prompt's causal attention: the C++ kernel and the torch reference."""
    from nanoengine.attention.backends.cpu_attn import CPUAttentionImpl
    from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl

    md, cache = paged_batch([prompt_len], [prompt_len], num_decodes=0)
    query = torch.randn(prompt_len, HEADS, HEAD_DIM)
    out = torch.zeros_like(query)
    scale = HEAD_DIM**-0.5
    fast, ref = CPUAttentionImpl(), TorchRefAttentionImpl()
    return {
        "fast": median_seconds(lambda: fast._prefill_batch(out, query, cache, md, scale), budget_s),
        "reference": median_seconds(lambda: ref._prefill_batch(out, query, cache, md, scale), budget_s),
    }


def time_decode(batch: int, context: int, budget_s: float) -> dict[str, float]:
    """Seconds for one decode step's attention over ``batch`` requests of ``context`` keys."""
    from nanoengine.attention.backends.cpu_attn import CPUAttentionImpl
    from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl

    md, cache = paged_batch([context] * batch, [1] * batch, num_decodes=batch)
    query = torch.randn(batch, HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    fast, ref = CPUAttentionImpl(), TorchRefAttentionImpl()
    return {
        "fast": median_seconds(lambda: fast._decode_batch(query, cache, md, scale), budget_s),
        "reference": median_seconds(lambda: ref._decode_batch(query, cache, md, scale), budget_s),
    }


def time_linear(rows: int, k: int, n: int, budget_s: float) -> dict[str, float]:
    """Seconds for x [rows, k] @ W^T [k, n] on every linear backend this process can run."""
    from nanoengine.model_executor.layers.cpu_linear import (
        cpu_gemm_usable,
        cpu_linear,
        onednn_supports,
        pack_cpu_weight,
        pack_weight,
    )

    x, weight = torch.randn(rows, k), torch.randn(n, k)
    found = {"reference": median_seconds(lambda: F.linear(x, weight), budget_s)}
    if cpu_gemm_usable(torch.device("cpu"), torch.float32):
        packed = pack_cpu_weight(weight)
        found["cpu"] = median_seconds(lambda: cpu_linear(x, packed, None, n), budget_s)
    if onednn_supports(torch.float32):
        onednn = pack_weight(weight)
        found["onednn"] = median_seconds(
            lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), budget_s
        )
    return found


def attention_flops(prompt_len: int) -> float:
    """Causal attention of one prompt: QK^T and PV over the lower triangle, every head."""
    return 2 * 2 * HEADS * HEAD_DIM * prompt_len * (prompt_len + 1) / 2


def run_child(quick: bool) -> dict[str, Any]:
    """Every measurement of this process's variant, as JSON-able rows."""
    from nanoengine._custom_ops import load_cpu_ops
    from nanoengine.platforms.cpu import kernel_isa

    load_cpu_ops()  # a compile (first use) is not timed
    budget = 0.5 if quick else 2.0
    prompt_lens = [16, 256, 2048] if quick else [16, 64, 256, 1024, 2048]
    batches = [1, 16, 64] if quick else [1, 4, 16, 32, 64]
    linear_rows = [1, 32, 2048] if quick else [1, 8, 32, 64, 256, 2048]
    rows: list[dict[str, Any]] = []
    for n in prompt_lens:
        rows.append(
            {
                "kind": "prefill attention",
                "shape": f"{n} tokens",
                "flops": attention_flops(n),
                **time_prefill(n, budget),
            }
        )
    for b in batches:
        rows.append(
            {
                "kind": "decode attention",
                "shape": f"batch {b} x 256 keys",
                "flops": 0.0,
                **time_decode(b, 256, budget),
            }
        )
    for name, (k, n) in LINEAR_SHAPES.items():
        for r in linear_rows:
            rows.append(
                {
                    "kind": f"linear {name}",
                    "shape": f"{r} x {k} -> {n}",
                    "flops": 2.0 * r * k * n,
                    **time_linear(r, k, n, budget),
                }
            )
    return {
        "isa": kernel_isa(),
        "aten": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "peak_gflops": measure_gemm_roofline(1024 if quick else 2048).gflops,
        "rows": rows,
    }


def print_report(result: dict[str, Any]) -> None:
    """One table per variant: seconds, GFLOP/s where meaningful, and each fast path's speed-up."""
    peak = result["peak_gflops"]
    print(
        f"\n== kernel variant {result['isa']} (ATen capability {result['aten']}, {result['threads']} threads); "
        f"measured fp32 matmul peak {peak:.0f} GFLOP/s"
    )
    print(f"{'kind':<20}{'shape':<26}{'reference':>12}{'fast paths (x reference)':>40}")
    for row in result["rows"]:
        ref = row["reference"]
        paths = []
        for name in ("fast", "cpu", "onednn"):
            if name in row:
                ratio = ref / row[name]
                mark = " SLOWER" if ratio < 1 else ""
                label = "kernel" if name == "fast" else name
                paths.append(f"{label} {row[name] * 1e3:.3f} ms ({ratio:.2f}x){mark}")
        extra = ""
        if row["kind"] == "prefill attention":
            gflops = row["flops"] / row["fast"] / 1e9
            extra = f"  [{gflops:.0f} GFLOP/s = {100 * gflops / peak:.0f}% of peak]"
        print(f"{row['kind']:<20}{row['shape']:<26}{ref * 1e3:>9.3f} ms   {'; '.join(paths)}{extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--isa", action="append", help="only this variant (repeatable); default: every one")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing budget")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.quick)))
        return 0
    print(f"CPU: {cpu_model_name()}, {os.cpu_count()} cores; flags: {' '.join(cpu_flags()) or '(unknown)'}")
    results = []
    for isa in args.isa or [isa for isa in supported_kernel_isas() if isa != "generic"]:
        env = {**os.environ, **isa_cap_environment(isa)}
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            *(["--quick"] if args.quick else []),
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            print(f"variant {isa} failed:\n{done.stderr[-3000:]}")
            return 1
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print_report(results[-1])
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_model_name(), "flags": cpu_flags(), "variants": results})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
