"""Chapter 6, tensor parallelism: one model over N worker processes, looked at while it runs.

``python -m chapters.ch06_construction --tensor-parallel-size 2`` runs this
part (and only this part) of chapter 6:

1. which executor ``LLM(tensor_parallel_size=N)`` picks, and why; the engine's
   component tree with its N workers;
2. the worker processes: rank, pid, host, threads;
3. every weight's shape in the checkpoint and on each rank, and the
   dimension it is split along (layers with the same shapes shown once);
4. the collectives of each engine step -- all-reduces and all-gathers, their
   count and bytes, counted on every rank -- against what the model's shape
   predicts, and the share of the step's time the ranks spend in them.

Everything is read from the live engine through ``collective_rpc``: the
functions of ``nanoengine/instruments/tp_inspection.py`` run on each rank.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from statistics import median
from typing import Any

import torch
from rich.markup import escape
from rich.table import Table

from chapters._common import console
from nanoengine import LLM, SamplingParams
from nanoengine.executor.abstract import Executor
from nanoengine.instruments.tp_inspection import (
    CollectiveTally,
    RankInfo,
    WeightShard,
    rank_info,
    start_collective_tally,
    stop_collective_tally,
    take_collective_tally,
    time_all_reduce,
    weight_shards,
)
from nanoengine.instruments.trace.data import StepTrace
from nanoengine.utils.mem_utils import format_bytes

# Token ids, not text: the stand-in model below has no tokenizer here. Three
# lengths, so the first step's prefill and the decode steps differ in size.
PROMPT_TOKEN_IDS = [list(range(100, 105)), list(range(200, 209)), list(range(300, 314))]
# The default model's 9 heads over 3 KV heads split over 1, 3 or 9 ranks only;
# for any other N the walkthrough says so and uses a real model's shapes that
# split over 2, 4 or 8 (16 heads over 8 KV heads), with random weights.
DEFAULT_MODEL_STAND_IN = "Qwen/Qwen3-0.6B"
TABLE_STEPS = 6  # rows of the per-step table (then the last step)
_LAYER_INDEX = re.compile(r"\.layers\.\d+\.")


@dataclass
class StepCollectives:
    """One engine step: what it scheduled and what every rank's collectives did."""

    step: int
    num_tokens: int  # tokens through the forward pass
    num_rows: int  # rows of logits (one per request sampled)
    tallies: list[CollectiveTally]  # rank order
    execute_seconds: float  # the step's model call, seen from the engine core

    def share(self, rank: int) -> float:
        """The part of the step's model call this rank spent inside collectives."""
        return self.tallies[rank].total_seconds / self.execute_seconds if self.execute_seconds else 0.0


@dataclass
class TensorParallelResult:
    backend: str
    backend_reason: str
    executor_class: str
    engine_tree: str  # print(llm.llm_engine)
    ranks: list[RankInfo]
    shards: list[list[WeightShard]]  # rank -> its parameters
    steps: list[StepCollectives]
    expected_all_reduces: int  # per step, from the model's shape
    expected_all_gathers: int
    hidden_size: int
    element_bytes: int  # of the activations the all-reduces carry
    model: str  # the model that ran (the stand-in when the default cannot split)
    output_token_ids: list[list[int]]
    decode_tokens: int  # tokens of the typical decode step (one per prompt)
    # One all-reduce of that step's [tokens, hidden] with every rank ready,
    # measured on the ranks right after the run: the collectives' own cost.
    idle_all_reduce_seconds: float


def backend_reason(tensor_parallel_size: int, asked: str | None, chosen: str) -> str:
    """Why ``chosen`` runs the workers, in the words of vLLM's default rule."""
    if asked is not None:
        return f"distributed_executor_backend={asked!r} was asked for."
    if tensor_parallel_size == 1:
        return "one rank: its worker runs in the engine core's process ('uni'); no process group is needed."
    return (
        f"distributed_executor_backend was left unset and tensor_parallel_size={tensor_parallel_size} > 1 "
        f"on one machine: vLLM's default is {chosen!r}, one worker process per rank started by the engine. "
        "'ray' is for ranks on several machines; 'uni' holds only one rank."
    )


# ------------------------------------------------------------------ weights
def layer_pattern(name: str) -> str:
    """``model.layers.7.mlp.down_proj.weight`` -> ``model.layers.*.mlp.down_proj.weight``."""
    return _LAYER_INDEX.sub(".layers.*.", name)


def shard_rows(shards: list[list[WeightShard]]) -> list[tuple[str, int, list[WeightShard]]]:
    """(name pattern, how many layers share it, that parameter on each rank), in model order.

    Every layer of a decoder has the same shapes, so one row stands for all of them.
    """
    rows: dict[str, tuple[int, list[WeightShard]]] = {}
    for position, shard in enumerate(shards[0]):
        pattern = layer_pattern(shard.name)
        count, first = rows.get(pattern, (0, [rank[position] for rank in shards]))
        rows[pattern] = (count + 1, first)
    return [(pattern, count, per_rank) for pattern, (count, per_rank) in rows.items()]


def shape_text(shape: tuple[int, ...]) -> str:
    """``(2048, 1024)`` -> ``[2048, 1024]``, as tensor shapes are written in the chapter."""
    return "[" + ", ".join(str(size) for size in shape) + "]"


def split_words(shard: WeightShard) -> str:
    """Which way a parameter is cut, in the terms of the chapter."""
    if shard.split_dim is None:
        return "whole"
    if shard.layer_type in ("VocabParallelEmbedding", "ParallelLMHead"):
        return "dim 0 (vocab)"
    return "dim 0 (column)" if shard.split_dim == 0 else "dim 1 (row)"


def shards_table(shards: list[list[WeightShard]]) -> Table:
    table = Table(title=f"Every weight: whole in the checkpoint, sliced on each of {len(shards)} ranks")
    for column in ("parameter", "layers", "layer type", "checkpoint", "split", *(f"rank {r}" for r in range(len(shards)))):
        table.add_column(column, justify="right" if column == "layers" else "left")
    for pattern, count, per_rank in shard_rows(shards):
        first = per_rank[0]
        table.add_row(pattern, str(count), first.layer_type, shape_text(first.full_shape), split_words(first),
                      *(shape_text(shard.shape) for shard in per_rank))
    totals = [sum(math.prod(shard.shape) for shard in rank) for rank in shards]
    whole = sum(math.prod(shard.full_shape) for shard in shards[0])
    table.caption = escape(
        "split: dim 0 (column) cuts a [out, in] weight's output rows, dim 1 (row) its input columns, dim 0 (vocab) "
        "the vocabulary; whole: copied to every rank.\nnumbers held: "
        + ", ".join(f"rank {rank} {total:,}" for rank, total in enumerate(totals))
        + f"; one process would hold {whole:,} (a vocabulary not divisible by N is padded)"
    )
    return table


# ------------------------------------------------------------------ collectives
def expected_collectives(num_layers: int) -> tuple[int, int]:
    """All-reduces and all-gathers per forward pass of a decoder at N > 1.

    Each layer sums twice (after ``o_proj`` and after ``down_proj``, the two
    row-parallel layers), the vocabulary-split embedding once; the LM head
    gathers its vocabulary slices once.
    """
    return 2 * num_layers + 1, 1


def run_steps(llm: LLM, executor: Executor, max_tokens: int) -> tuple[list[StepCollectives], list[list[int]]]:
    """Generate for ``PROMPT_TOKEN_IDS`` step by step, taking every rank's tally after each step."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, token_ids in enumerate(PROMPT_TOKEN_IDS):
        engine.add_request(f"tp-{index}", {"prompt_token_ids": token_ids}, params)
    trace = llm.trace
    if trace is None:
        raise RuntimeError("the walkthrough's engine needs trace=True")
    executor.collective_rpc(start_collective_tally)
    steps: list[StepCollectives] = []
    outputs: dict[str, list[int]] = {}
    try:
        while engine.has_unfinished_requests():
            seen = len(trace.steps)
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = list(output.outputs[0].token_ids)
            tallies: list[CollectiveTally] = executor.collective_rpc(take_collective_tally)
            steps.extend(_step_collectives(step, tallies) for step in trace.steps[seen:])
    finally:
        executor.collective_rpc(stop_collective_tally)
    return steps, [outputs[f"tp-{index}"] for index in range(len(PROMPT_TOKEN_IDS))]


def _step_collectives(step: StepTrace, tallies: list[CollectiveTally]) -> StepCollectives:
    return StepCollectives(
        step=step.step,
        num_tokens=sum(chunk.num_tokens for chunk in step.scheduled),
        # A request samples once its prompt is all in (decode steps, the last prefill chunk).
        num_rows=sum(1 for chunk in step.scheduled if chunk.start + chunk.num_tokens >= chunk.num_prompt_tokens),
        tallies=tallies,
        execute_seconds=step.execute_s,
    )


def collectives_table(result: TensorParallelResult) -> Table:
    table = Table(title="Collectives per engine step (counted on every rank; rank 0 shown)")
    for column in ("step", "tokens", "all-reduce", "all-reduce bytes", "all-gather", "all-gather bytes",
                   "in collectives", "model call", "share"):
        table.add_column(column, justify="right")
    shown = result.steps if len(result.steps) <= TABLE_STEPS else result.steps[: TABLE_STEPS - 1] + result.steps[-1:]
    for step in shown:
        if step is result.steps[-1] and len(shown) < len(result.steps):
            table.add_row("...", f"({len(result.steps) - len(shown)} decode steps like these)", *[""] * 7)
        tally = step.tallies[0]
        table.add_row(
            str(step.step), str(step.num_tokens),
            str(tally.calls["all_reduce"]), format_bytes(tally.bytes["all_reduce"]),
            str(tally.calls["all_gather"]), format_bytes(tally.bytes["all_gather"]),
            f"{tally.total_seconds * 1e3:.1f} ms", f"{step.execute_seconds * 1e3:.1f} ms",
            f"{step.share(0):.0%}",
        )
    table.caption = escape(
        f"expected per step: {result.expected_all_reduces} all-reduces of [tokens, {result.hidden_size}] x "
        f"{result.element_bytes} B (2 per layer + the embedding) and {result.expected_all_gathers} all-gather of "
        "the logits. 'model call': the step's execute time in the engine core."
    )
    return table


def tally_mismatches(result: TensorParallelResult) -> list[str]:
    """Steps whose counts or bytes differ from the formula, or between ranks (none expected)."""
    problems = []
    for step in result.steps:
        calls = [(t.calls["all_reduce"], t.calls["all_gather"], t.bytes["all_reduce"]) for t in step.tallies]
        expected = (result.expected_all_reduces, result.expected_all_gathers,
                    result.expected_all_reduces * step.num_tokens * result.hidden_size * result.element_bytes)
        if any(got != expected for got in calls):
            problems.append(f"step {step.step}: ranks {calls}, expected {expected}")
    return problems


# ------------------------------------------------------------------ the section
def build_engine(model: str, tensor_parallel_size: int, backend: str | None, engine_kwargs: dict[str, Any],
                 default_model: str) -> tuple[LLM, str]:
    """The engine on N ranks, and the model it runs.

    The size check runs before any worker starts, so a model whose heads do
    not split over N costs one ValueError; for the default model the
    walkthrough shows it and goes on with the stand-in.
    """
    options = dict(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend=backend, trace=True,
                   **engine_kwargs)
    try:
        return LLM(model, **options), model
    except ValueError as error:
        if model != default_model or "must divide" not in str(error):
            raise
        console.print(f"[yellow]{model}: {error}[/yellow]\nUsing {DEFAULT_MODEL_STAND_IN}'s shapes instead, with "
                      "random weights (load_format='dummy'): the split and the collectives are the same as with "
                      "its real weights, the tokens are meaningless.")
    stand_in = LLM(DEFAULT_MODEL_STAND_IN, load_format="dummy", skip_tokenizer_init=True, **options)
    return stand_in, DEFAULT_MODEL_STAND_IN


def run(model: str, tensor_parallel_size: int, backend: str | None, max_tokens: int,
        engine_kwargs: dict[str, Any], default_model: str) -> TensorParallelResult:
    llm, model = build_engine(model, tensor_parallel_size, backend, engine_kwargs, default_model)
    try:
        return _walk(llm, model, tensor_parallel_size, backend, max_tokens)
    finally:
        llm.llm_engine.shutdown()


def _walk(llm: LLM, model: str, tensor_parallel_size: int, backend: str | None, max_tokens: int
          ) -> TensorParallelResult:
    engine_config = llm.llm_engine.engine_config
    executor = llm.llm_engine.engine_core.get_engine_core().model_executor
    chosen = engine_config.parallel_config.distributed_executor_backend or "uni"
    console.rule(f"6. Tensor parallelism: {model} on {tensor_parallel_size} ranks")
    reason = backend_reason(tensor_parallel_size, backend, chosen)
    console.print(f"executor: {type(executor).__name__} (distributed_executor_backend={chosen!r})\n  why: {reason}")
    tree = str(llm.llm_engine)
    console.print(tree)

    console.rule("6.1 The worker processes")
    ranks: list[RankInfo] = executor.collective_rpc(rank_info)
    table = Table(title=f"{len(ranks)} ranks, one process each (the engine core: pid {os.getpid()})")
    for column in ("rank", "pid", "host", "torch threads", "device"):
        table.add_column(column)
    for info in ranks:
        table.add_row(f"{info.rank}/{info.world_size}", str(info.pid), info.host, str(info.threads), info.device)
    console.print(table)

    console.rule("6.2 Every weight, and each rank's slice of it")
    shards: list[list[WeightShard]] = executor.collective_rpc(weight_shards)
    console.print(shards_table(shards))

    console.rule("6.3 The collectives of each step")
    text_config = engine_config.model_config.hf_text_config
    all_reduces, all_gathers = expected_collectives(text_config.num_hidden_layers)
    steps, output_token_ids = run_steps(llm, executor, max_tokens)
    decode_tokens = len(PROMPT_TOKEN_IDS)
    idle_seconds = max(executor.collective_rpc(time_all_reduce, args=(decode_tokens * text_config.hidden_size,)))
    result = TensorParallelResult(
        backend=chosen, backend_reason=reason, executor_class=type(executor).__name__, engine_tree=tree,
        ranks=ranks, shards=shards, steps=steps, expected_all_reduces=all_reduces,
        expected_all_gathers=all_gathers, hidden_size=text_config.hidden_size,
        element_bytes=getattr(torch, engine_config.model_config.dtype).itemsize, model=model,
        output_token_ids=output_token_ids, decode_tokens=decode_tokens, idle_all_reduce_seconds=idle_seconds,
    )
    console.print(collectives_table(result))
    problems = tally_mismatches(result)
    console.print("every step matched the formula on every rank" if not problems else "\n".join(problems))
    _print_shares(result)
    return result


def decode_steps(result: TensorParallelResult) -> list[StepCollectives]:
    """The steps that ran one token per request (every prompt already in)."""
    return [step for step in result.steps if step.num_tokens == step.num_rows]


def _print_shares(result: TensorParallelResult) -> None:
    decodes = decode_steps(result)
    prefills = [step for step in result.steps if step not in decodes]
    for kind, steps in (("prefill", prefills), ("decode", decodes)):
        if steps:
            shares = ", ".join(f"rank {rank} {median(step.share(rank) for step in steps):.0%}"
                               for rank in range(len(result.ranks)))
            console.print(f"{kind} steps ({len(steps)}): median share of the model call in collectives: {shares}")
    if decodes:
        waited = median(step.tallies[0].total_seconds for step in decodes)
        floor = result.idle_all_reduce_seconds * result.expected_all_reduces
        console.print(
            f"One all-reduce of [{result.decode_tokens}, {result.hidden_size}] with both ranks ready takes "
            f"{result.idle_all_reduce_seconds * 1e3:.2f} ms here, so a decode step's {result.expected_all_reduces} "
            f"cost at least {floor * 1e3:.0f} ms; rank 0 spent a median {waited * 1e3:.0f} ms in them: the rest is "
            "waiting for the other rank to reach the same sum."
        )
    console.print("On one CPU the ranks share the cores and the memory bus with each other and with the engine core: "
                  "tensor parallelism pays where each rank has a device of its own and a fast link to its peers.")
    console.print(f"{sum(map(len, result.output_token_ids))} tokens generated (random weights: the ids mean nothing)"
                  if result.model == DEFAULT_MODEL_STAND_IN else f"greedy token ids out: {result.output_token_ids}")
