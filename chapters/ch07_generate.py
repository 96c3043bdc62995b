"""Chapter 7 -- ``generate(...)``: the engine loop and the model runner, one step at a time.

Construction (chapter 6) decided how many requests the machine can hold; the
loop decides how long each takes. This walkthrough drives ``EngineCore`` by
hand, the way ``EngineCore.step`` does, and prints what travels at each stage:

1. scheduler output: which requests run, how many tokens each, which blocks;
2. model inputs: the flattened token ids and positions (decodes first);
3. attention metadata: query start offsets, sequence lengths, block table, slots;
4. logits for the rows that sample, and the sampled tokens;
5. the CUDA-graph dispatcher's choice for every step of a real run, then one
   decode step padded to its graph size and run eagerly through the Triton
   backend (in Triton's interpreter on a CPU) -- the exact code path up to the
   replay -- with the real rows' logits compared to the unpadded step;
6. the same prompts with ``async_scheduling=True``: how many steps were
   scheduled while the step before was still running, and whether the tokens
   are the same.

    python -m chapters.ch07_generate [--model DIR] [--steps N] [--skip-graph-sim]
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch
from rich.table import Table

from chapters._common import base_parser, console, engine_parts
from nanoengine import LLM, SamplingParams
from nanoengine.instruments.method_taps import tap
from nanoengine.worker.cudagraph_dispatcher import (
    CudagraphDecision,
    CudagraphDispatcher,
    default_capture_sizes,
    pad_decode_inputs,
)
from nanoengine.worker.input_batch import StepInputs, order_decodes_first
from nanoengine.worker.model_runner import ModelRunner

# Step 5 runs the Triton kernels; without CUDA only Triton's interpreter can, and
# it must be switched on before anything imports triton.language.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

PROMPTS = ["The capital of France is", "def reverse(xs):", "Once upon a time, there"]


@dataclass
class StepRecord:
    num_scheduled: dict[str, int]
    input_ids: list[int]
    positions: list[int]
    sampled: dict[str, list[int]]
    graph_reason: str


@dataclass
class Ch07Result:
    steps: list[StepRecord]
    decisions: Counter[str]  # reason prefix -> steps
    padded_size: int
    padded_max_abs_diff: float  # real rows' logits, padded vs unpadded step
    async_steps: int  # LLMEngine.step() calls of the async-scheduling run
    async_overlapped: int  # of those, steps scheduled while the previous one still ran
    async_same_tokens: bool  # async scheduling generated exactly the synchronous tokens


class ForwardWatch:
    """What the model runner's latest forward pass was given, its CUDA-graph decision,
    and the logits its sampler got.

    Read from outside through method taps (``nanoengine/instruments/method_taps.py``):
    the runner keeps no copy of any of them for this walkthrough.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.inputs: StepInputs | None = None
        self.decision: CudagraphDecision | None = None
        self.logits: torch.Tensor | None = None  # [num_sampling_reqs, vocab]
        tap(runner, "_forward", before=self._saw_inputs)
        tap(runner.dispatcher, "dispatch", after=self._saw_decision)
        tap(runner.sampler, "forward", before=self._saw_logits)

    def _saw_inputs(self, inputs: StepInputs, *rest: object) -> None:
        self.inputs = inputs

    def _saw_decision(self, decision: CudagraphDecision, *args: int) -> None:
        self.decision = decision

    def _saw_logits(self, logits: torch.Tensor, *args: object) -> None:
        self.logits = logits


def one_step(llm: LLM, watch: ForwardWatch, show: bool) -> StepRecord:
    """EngineCore.step, unrolled: schedule -> execute_model -> sample_tokens -> update.

    The outputs then go to the front end's output processor, as
    ``LLMEngine.step`` would send them, so requests finish there too.
    """
    core, _ = engine_parts(llm)
    scheduler_output = core.scheduler.schedule()
    core.model_executor.execute_model(scheduler_output)  # forward pass, logits kept
    watch.logits = None  # a step with no row to sample never calls the sampler
    model_output = core.model_executor.sample_tokens(None)
    inputs, decision, logits = watch.inputs, watch.decision, watch.logits
    outputs = core.scheduler.update_from_output(scheduler_output, model_output)
    llm.llm_engine.output_processor.process_outputs(outputs.outputs)
    assert inputs is not None and decision is not None
    record = StepRecord(
        num_scheduled=dict(scheduler_output.num_scheduled_tokens),
        input_ids=inputs.input_ids.tolist(),
        positions=inputs.positions.tolist(),
        sampled=model_output.by_request(),
        graph_reason=decision.reason,
    )
    if show:
        md = inputs.attn_metadata
        table = Table(title="one step, stage by stage", show_header=False)
        table.add_row("1 scheduler output", f"num_scheduled_tokens={record.num_scheduled}")
        table.add_row("", f"new={[r.req_id for r in scheduler_output.scheduled_new_reqs]} "
                      f"cached={scheduler_output.scheduled_cached_reqs.req_ids}")
        table.add_row("2 model inputs", f"input_ids={_short(record.input_ids)}")
        order = order_decodes_first(scheduler_output.num_scheduled_tokens)  # the runner's batch order
        table.add_row("", f"positions={_short(record.positions)} req order={order}")
        table.add_row("3 attention metadata", f"query_start_loc={md.query_start_loc_cpu} seq_lens={md.seq_lens_cpu}")
        table.add_row("", f"block_table={md.block_table.tolist()} slot_mapping={_short(md.slot_mapping.tolist())}")
        shape = "none" if logits is None else f"{list(logits.shape)} (rows={inputs.sampling_req_ids})"
        table.add_row("4 logits", shape)
        table.add_row("5 sampled tokens", f"{record.sampled}")
        table.add_row("CUDA graph", decision.reason)
        console.print(table)
    return record


def _short(values: list[int], keep: int = 12) -> str:
    return str(values) if len(values) <= keep else f"{values[:keep]} ... ({len(values)} in all)"


def simulate_graph_step(llm: LLM, watch: ForwardWatch, max_num_seqs: int) -> tuple[int, float]:
    """Pad one real decode step to its graph size and run it eagerly with Triton."""
    from nanoengine.attention.layer import set_attention_impl
    from nanoengine.attention.selector import get_attention_impl

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    core, runner = engine_parts(llm)
    for i, prompt in enumerate(PROMPTS):
        llm.llm_engine.add_rendered_request(f"sim-{i}", llm.llm_engine.renderer.render_prompt(prompt), params)
    model = runner.get_model()
    set_attention_impl(model, get_attention_impl("triton"))  # what CUDA would use
    while True:
        one_step(llm, watch, show=False)
        inputs = watch.inputs
        assert inputs is not None
        if inputs.attn_metadata.num_actual_tokens == inputs.attn_metadata.num_reqs:
            break  # a pure decode step: the kind a graph replays
    dispatcher = CudagraphDispatcher(default_capture_sizes(max_num_seqs), runner.max_blocks_per_req)
    md = inputs.attn_metadata
    decision = dispatcher.dispatch(md.num_reqs, md.num_actual_tokens, md.block_table.shape[1])
    padded = pad_decode_inputs(inputs, decision.padded_batch_size, runner.max_blocks_per_req)
    with torch.inference_mode():
        # Re-running writes the same K/V into the same slots, so both runs see
        # the same cache: only the padding differs.
        lm = runner._model()  # the same model, typed by the methods called here
        eager = lm.compute_logits(lm(inputs.input_ids, inputs.positions, md))
        graph_path = lm.compute_logits(lm(padded.input_ids, padded.positions, padded.attn_metadata))
    set_attention_impl(model, get_attention_impl(runner.attention_backend))
    while core.scheduler.has_requests():
        one_step(llm, watch, show=False)
    diff = float((graph_path[: md.num_reqs] - eager).abs().max())
    console.print(
        f"{decision.reason}: padded rows' slots={padded.attn_metadata.slot_mapping.tolist()}; "
        f"real rows' logits differ from the unpadded step by at most {diff:.2e}"
    )
    return decision.padded_batch_size, diff


def compare_async(model: str, llm_kwargs: dict[str, int], params: SamplingParams) -> tuple[int, int, bool]:
    """Generate ``PROMPTS`` with and without async scheduling, one step at a time.

    Returns (async steps, of which overlapped, same tokens). A step overlaps
    when its ``schedule()`` runs while the step before is still in the batch
    queue, i.e. before that step's tokens are known.
    """
    tokens: dict[bool, dict[str, list[int]]] = {}
    num_steps = num_overlapped = 0
    for async_scheduling in (False, True):
        llm = LLM(model, async_scheduling=async_scheduling, **llm_kwargs)
        engine, core = llm.llm_engine, engine_parts(llm)[0]
        for i, prompt in enumerate(PROMPTS):
            engine.add_rendered_request(f"req-{i}", engine.renderer.render_prompt(prompt), params)
        tokens[async_scheduling] = {}
        while engine.has_unfinished_requests():
            if async_scheduling:
                num_steps += 1
                num_overlapped += bool(core.batch_queue) and core.scheduler.has_requests()
            for out in engine.step():
                if out.finished:
                    tokens[async_scheduling][out.request_id] = out.outputs[0].token_ids
        engine.shutdown()
    same = tokens[True] == tokens[False]
    console.print(
        f"async scheduling: {num_steps} steps, {num_overlapped} scheduled while the previous step ran; "
        f"tokens identical to the synchronous loop: {same}"
    )
    return num_steps, num_overlapped, same


def main(argv: list[str] | None = None) -> Ch07Result:
    parser = base_parser(__doc__ or "", __name__)
    parser.add_argument("--steps", type=int, default=3, help="steps printed stage by stage")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--skip-graph-sim", action="store_true", help="skip the Triton-interpreter step")
    args = parser.parse_args(argv)
    llm_kwargs = {"max_num_seqs": args.max_num_seqs, "max_model_len": 512, "max_num_batched_tokens": 64,
                  "kv_cache_memory_bytes": 64 << 20}
    llm = LLM(args.model, **llm_kwargs)
    core, runner = engine_parts(llm)
    watch = ForwardWatch(runner)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        llm.llm_engine.add_rendered_request(f"req-{i}", llm.llm_engine.renderer.render_prompt(prompt), params)

    console.rule("1-5. The engine loop, unrolled (a 64-token budget: long prompts are chunked)")
    steps: list[StepRecord] = []
    while core.scheduler.has_requests():
        steps.append(one_step(llm, watch, show=len(steps) < args.steps))
    console.print(f"... {len(steps)} steps in all")

    console.rule("CUDA-graph dispatcher, simulated for this run on a CUDA ladder")
    dispatcher = CudagraphDispatcher(default_capture_sizes(args.max_num_seqs), runner.max_blocks_per_req)
    decisions: Counter[str] = Counter()
    for step in steps:
        num_tokens = sum(step.num_scheduled.values())
        if num_tokens == 0:
            continue  # a step that only told the worker about finished requests
        decision = dispatcher.dispatch(len(step.num_scheduled), num_tokens, 1)
        decisions[decision.reason.split(":")[0].split(" padded")[0]] += 1
    console.print(f"capture sizes {dispatcher.capture_sizes}; decisions: {dict(decisions)}")

    padded_size, diff = (0, 0.0)
    if not args.skip_graph_sim:
        console.rule("The path up to replay: pad a decode step, run it with the Triton backend")
        padded_size, diff = simulate_graph_step(llm, watch, args.max_num_seqs)

    console.rule("6. Async scheduling: step N+1 is scheduled while step N runs")
    async_steps, overlapped, same = compare_async(args.model, llm_kwargs, params)
    return Ch07Result(
        steps=steps, decisions=decisions, padded_size=padded_size, padded_max_abs_diff=diff,
        async_steps=async_steps, async_overlapped=overlapped, async_same_tokens=same,
    )


if __name__ == "__main__":
    main()
