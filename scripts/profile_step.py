"""Where a decode step's time goes, by part, in one dtype (chapter 7).

Chapter 7 ("Where a CPU step spends its time", and its bf16 section) quotes
these figures. A real engine runs ``--batch`` requests with ``--context``-token
prompts; once every request decodes, each step is timed whole and by part:

* matmuls: every ``Linear`` of the decoder layers (qkv, o, gate_up, down);
* LM head: the [hidden -> vocab] product that makes the logits;
* attention: the K/V write and the paged decode attention kernel;
* norms, RoPE, SiLU: the small per-layer kernels (chapter 7's custom ops);
* the rest of the forward: the Python that walks the layers and calls the above;
* sampling: from logits to token ids;
* the engine: scheduling, input preparation and output processing.

Each part is timed through method taps (``nanoengine/instruments/method_taps.py``) on
the live objects, so the engine's code is not touched. It also prints the
bytes a step must stream from memory: every weight once per step, and every
cached K/V row of every request once. Run it once per dtype, in separate
processes (chapter 7 explains why one process should run one engine):

    python scripts/profile_step.py --dtype float32
    python scripts/profile_step.py --dtype bfloat16

``--prefill`` times the other kind of step instead: one prompt of
``--context`` tokens (2,048 for the profile pass ``LLM(...)`` runs at start-up,
chapter 6), prefilled ``--steps`` times with fresh token ids. Run it once per
kernel variant (``NANOENGINE_CPU_ISA=avx2`` caps it; chapter 7's per-ISA table).

vLLM 0.32 counterpart: none; vLLM profiles with ``torch.profiler``, which does
not see nanoengine's pybind11 kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

from nanoengine import LLM, SamplingParams
from nanoengine.executor.uniproc_executor import UniProcExecutor
from nanoengine.instruments.method_taps import tap
from nanoengine.model_executor.custom_op import CustomOp
from nanoengine.model_executor.layers.cpu_linear import PackableLinear
from nanoengine.model_executor.layers.layernorm import RMSNorm
from nanoengine.platforms.cpu import cpu_flags, cpu_model_name, kernel_isa
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.utils.mem_utils import format_bytes
from nanoengine.worker.model_runner import ModelRunner


class PartTimer:
    """Seconds spent in each tapped part during the current step (one thread calls them all).

    A call inside another call of the same part (the torch RMSNorm's
    ``forward_with_residual`` calls its ``forward``) is counted once, by the outer one.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[tuple[str, float]] = []  # (part, start) of the calls in progress

    def watch(self, obj: object, method: str, part: str) -> None:
        def begin(*_: object, **__: object) -> None:
            self._open.append((part, time.perf_counter()))

        def end(*_: object, **__: object) -> None:
            start = self._open.pop()[1]
            if all(outer != part for outer, _ in self._open):
                self.seconds[part] += time.perf_counter() - start

        tap(obj, method, before=begin, after=end)

    @contextmanager
    def step(self) -> Iterator[dict[str, float]]:
        """Zero the parts, run the step inside, leave its parts (and "step") in the yielded dict."""
        self.seconds.clear()
        result: dict[str, float] = {}
        start = time.perf_counter()
        yield result
        result.update(self.seconds, step=time.perf_counter() - start)


def model_runner(llm: LLM) -> ModelRunner:
    executor = llm.llm_engine.engine_core.get_engine_core().model_executor
    assert isinstance(executor, UniProcExecutor), "the profile reads the worker in this process (one rank)"
    runner = executor.driver_worker.model_runner
    assert runner is not None, "the worker has no model runner yet"
    return runner


def attach(llm: LLM, timer: PartTimer) -> None:
    runner = model_runner(llm)
    model = runner.get_model()
    for name, module in model.named_modules():
        if isinstance(module, PackableLinear):
            timer.watch(module, "matmul", "LM head" if name.endswith("lm_head") else "matmuls")
        elif isinstance(module, CustomOp):
            timer.watch(module, "forward", "norms, RoPE, SiLU")
            if isinstance(module, RMSNorm):
                timer.watch(module, "forward_with_residual", "norms, RoPE, SiLU")
    impl = next(m.impl for m in model.modules() if hasattr(m, "impl"))
    timer.watch(impl, "_write", "attention")
    timer.watch(impl, "_decode_batch", "attention")
    timer.watch(impl, "_prefill_batch", "attention")
    timer.watch(runner, "_forward", "forward")
    timer.watch(runner.sampler, "forward", "sampling")


def profile(args: argparse.Namespace) -> tuple[LLM, list[dict[str, float]]]:
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False,
              max_num_seqs=args.batch, max_model_len=args.context + args.steps + 16,
              quantization=args.quantization)
    timer = PartTimer()
    attach(llm, timer)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
    for i in range(args.batch):
        prompt: TokensPrompt = {"prompt_token_ids": [(13 * i + 7 * j) % 4000 + 10 for j in range(args.context)]}
        engine.add_rendered_request(f"r{i}", engine.renderer.render_prompt(prompt), params)
    core = engine.engine_core.get_engine_core()
    steps: list[dict[str, float]] = []
    while engine.has_unfinished_requests():
        decoding = not core.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                                        for r in core.scheduler.running)
        with timer.step() as parts:
            engine.step()
        if decoding and len(core.scheduler.running) == args.batch:
            steps.append(parts)
    return llm, steps[1:]  # the first full decode step still pays first-touch costs


def profile_prefill(args: argparse.Namespace) -> tuple[LLM, list[dict[str, float]]]:
    """``--steps`` prefill steps of one fresh ``--context``-token prompt each (one token generated)."""
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False, max_num_seqs=1,
              max_model_len=args.context + 16, max_num_batched_tokens=max(args.context, 256),
              quantization=args.quantization)
    timer = PartTimer()
    attach(llm, timer)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    steps: list[dict[str, float]] = []
    for i in range(args.steps + 1):
        # Ids below 260 fit any test model's vocabulary; no prefix cache, so repeats cost the same.
        prompt: TokensPrompt = {"prompt_token_ids": [(13 * i + 7 * j) % 250 + 10 for j in range(args.context)]}
        engine.add_rendered_request(f"p{i}", engine.renderer.render_prompt(prompt), params)
        with timer.step() as parts:
            engine.step()  # the whole prompt fits one step: prefill and its one token
        steps.append(parts)
        while engine.has_unfinished_requests():
            engine.step()
    return llm, steps[1:]  # the first step still pays first-touch costs


def report(args: argparse.Namespace, llm_steps: list[dict[str, float]], console: Console) -> None:
    def median_ms(part: str) -> float:
        return statistics.median(s.get(part, 0.0) for s in llm_steps) * 1e3

    step = median_ms("step")
    parts = {part: median_ms(part) for part in ("matmuls", "LM head", "attention", "norms, RoPE, SiLU")}
    parts["the rest of the forward"] = median_ms("forward") - sum(parts.values())
    parts["sampling"] = median_ms("sampling")
    parts["the engine"] = step - median_ms("forward") - parts["sampling"]
    kind = (f"prefill step, one prompt of {args.context} tokens" if getattr(args, "prefill", False)
            else f"decode step, batch {args.batch}, ~{args.context} cached tokens each")
    table = Table(title=f"{kind}, {args.dtype}, kernel variant {kernel_isa()}")
    for column in ("part", "median ms", "share"):
        table.add_column(column, justify="left" if column == "part" else "right")
    for part, ms in parts.items():
        table.add_row(part, f"{ms:.1f}", f"{ms / step:.0%}")
    table.add_row("step", f"{step:.1f}", "100%")
    console.print(table)
    if getattr(args, "prefill", False):
        console.print(f"{len(llm_steps)} steps measured; {args.context / step * 1e3:.0f} prompt tok/s")
    else:
        console.print(f"{len(llm_steps)} steps measured; {args.batch / step * 1e3:.0f} decode tok/s")


def bytes_per_step(args: argparse.Namespace, llm: LLM, console: Console) -> None:
    """What one decode step must read from memory, from the model's shape."""
    runner = model_runner(llm)
    weights = runner.weights_bytes()
    spec = llm.llm_engine.engine_core.get_engine_core().kv_cache_config.spec  # the full-attention layers
    kv_per_token = spec.page_size_bytes // spec.block_size  # K and V rows of every such layer
    kv = kv_per_token * args.batch * args.context
    console.print(
        f"bytes per step: weights {format_bytes(weights)} + K/V {format_bytes(kv)} "
        f"({format_bytes(kv_per_token)} per cached token) = {format_bytes(weights + kv)}; "
        f"per generated token {format_bytes((weights + kv) // args.batch)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=250, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=12, help="steps measured")
    parser.add_argument("--prefill", action="store_true", help="time prefill steps of one prompt instead")
    parser.add_argument("--quantization", choices=["gguf"], default=None,
                        help="gguf: the model's GGUF blocks (the prepared SmolLM2 keeps its file beside it)")
    args = parser.parse_args(argv)
    console = Console()
    console.print(f"CPU: {cpu_model_name()}; flags: {' '.join(cpu_flags())}")
    if args.prefill:
        llm, steps = profile_prefill(args)
        report(args, steps, console)
        return 0
    llm, steps = profile(args)
    report(args, steps, console)
    bytes_per_step(args, llm, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
