"""Chapter 9 -- speculative decoding: n-gram drafts, verified by the target model in one step.

A decode step reads every weight to produce one token per request. With
``speculative_config={"method": "ngram", ...}`` the engine guesses the next
``k`` tokens of a request from its own earlier tokens, feeds the last known
token and the ``k`` guesses (*drafts*) through the model in one step, and keeps
the drafts the model agrees with, plus one token of its own. This walkthrough
drives ``EngineCore`` by hand (as ``EngineCore.step`` and ``post_step`` do) on
a prompt that asks the model to repeat a passage, and prints:

1. every step of that one request: its last known tokens, the drafts booked
   with it, which were accepted and which rejected (position by position),
   the bonus or recovered token, and ``num_computed_tokens`` before the step,
   after the scheduler booked it, and after the roll-back of rejected drafts;
2. the KV blocks around the first rejection: the request's block table, which
   slots now hold verified tokens and which hold rejected drafts, that no block
   holding a draft was cached, and that the next step overwrites the stale slots;
3. acceptance per draft position and the mean acceptance length, read from the
   scheduler's ``SpecDecodingStats``;
4. the same prompts with and without speculation, side by side: steps,
   tokens/s, their ratio, the CPU they ran on, and whether the greedy texts are
   identical (they must be).

    python -m chapters.ch09_spec_decode [--model DIR] [--max-tokens N] [-k K]
                                        [--draft-length {fixed,adaptive}] [--dtype float32]
                                        [--repeats N] [--skip-speed]

vLLM 0.32 counterpart: ``vllm/v1/spec_decode/ngram_proposer.py``,
``vllm/v1/sample/rejection_sampler.py``, ``vllm/v1/core/sched/scheduler.py``
(drafts booked and rolled back) and ``vllm/v1/engine/core.py`` (``post_step``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from rich.table import Table

from chapters._common import base_parser, console, engine_parts
from nanoengine import LLM, SamplingParams
from nanoengine.engine import FinishReason
from nanoengine.instruments.method_taps import tap
from nanoengine.platforms.cpu import describe_cpu
from nanoengine.request import Request
from nanoengine.spec_decode.metrics import SpecDecodingStats
from nanoengine.worker.model_runner import ModelRunner

# Text the answer copies: every draft the n-gram proposer makes comes from here.
PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. Actions speak louder than words. Where there is smoke, there is fire. "
    "The early bird catches the worm. Practice makes perfect. Knowledge is power."
)
BY_HAND_PROMPT = f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"
# Section 4: answers grounded in their prompts, the case prompt lookup is for.
SPEED_PROMPTS = [
    BY_HAND_PROMPT,
    (
        "Rewrite this Python function with type hints, keeping everything else the same:\n\n"
        "def add_all(xs):\n    total = 0\n    for x in xs:\n        total = total + x\n    return total\n"
    ),
    (
        "Copy this shopping list, one item per line, in the same order:\n"
        "apples, bread, milk, eggs, butter, cheese, tomatoes, onions, rice, coffee"
    ),
]
REQUEST_ID = "repeat-0"


@dataclass
class StepRecord:
    """What one engine step did to the walkthrough's request."""

    step: int
    num_computed_before: int  # before schedule()
    num_scheduled: int  # tokens booked: 1 + drafts for a verification step
    num_computed_booked: int  # after schedule(): every booked token counted as computed
    num_computed_after: int  # after update_from_output(): rejected drafts un-counted
    last_known: list[int]  # the request's last few known tokens before the step
    drafts: list[int]  # drafts scheduled with the step (empty: none)
    sampled: list[int]  # what the worker returned: kept drafts, then one token of the target's
    num_accepted: int
    num_rejected: int
    # Of ``sampled``, the tokens the request kept: the rest fell past max_tokens
    # (or after a stop token) and were dropped by update_from_output().
    num_appended: int
    finish_reason: FinishReason | None  # None while the request runs

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_before == 0


@dataclass
class SlotRecord:
    """One KV slot written by the first step with a rejection."""

    position: int
    token: int
    role: str  # "last known token", "draft d_0", ...
    block_id: int
    offset: int
    fate: str  # "verified" or "rejected draft"


@dataclass
class RejectionView:
    """Section 2: the KV blocks of the request around its first rejection."""

    step: int
    block_ids_before: list[int]
    block_ids_after: list[int]
    slots: list[SlotRecord]
    cached_block_ids: list[int]  # blocks of the request with a hash after the step
    draft_block_ids: list[int]  # blocks holding a slot a draft was written to this step
    # After the next step (None when the request ended with the rejection step):
    # what became of each rejected slot, and whether every verified slot kept its K.
    rewrites: list[Rewrite] | None = None
    verified_unchanged: bool | None = None
    next_step_seq_len: int | None = None


@dataclass
class Rewrite:
    """A rejected draft's slot, one step later."""

    position: int
    old_token: int  # the rejected draft
    new_token: int | None  # what the next step fed at this position; None: past its seq_len, not written
    k_changed: bool  # layer 0's K at the slot differs from what the rejected draft left

    @property
    def as_expected(self) -> bool:
        """K changes exactly when another token was written: K depends on the token and its position only."""
        return self.k_changed == (self.new_token is not None and self.new_token != self.old_token)


@dataclass
class SpeedResult:
    """Section 4: one side-by-side run."""

    tok_per_s: dict[str, float]  # "plain" / "ngram" -> generated tokens per second (best repeat)
    steps: dict[str, int]  # engine steps that ran the model, per run
    num_tokens: int  # tokens generated per run (the same on both sides)
    same_text: bool
    mean_acceptance_length: float | None
    cpu: str

    @property
    def ratio(self) -> float:
        return self.tok_per_s["ngram"] / self.tok_per_s["plain"]


@dataclass
class Ch09Result:
    """What the walkthrough observed (tests assert on it)."""

    steps: list[StepRecord]
    text: str
    output_token_ids: list[int]
    rejection: RejectionView | None
    stats: SpecDecodingStats
    speed: SpeedResult | None = None


def spec_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "draft_length": args.draft_length,
    }


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The settings both engines share: small blocks (so a request spans several)
    and a small KV cache (two engines live side by side in section 4)."""
    return {"dtype": args.dtype, "block_size": args.block_size, "max_model_len": 512,
            "kv_cache_memory_bytes": 64 << 20}


# ---------------------------------------------------------------- section 1 and 2


def step_by_hand(llm: LLM, request: Request) -> tuple[StepRecord, dict[str, Any]]:
    """One ``EngineCore.step`` and ``post_step``, unrolled, watching ``request``.

    Returns the step's record and what section 2 needs (block ids, slot ranges).
    """
    core, _ = engine_parts(llm)
    scheduler = core.scheduler
    blocks = scheduler.kv_cache_manager.get_block_ids
    before = request.num_computed_tokens
    last_known = request.all_token_ids[-4:]
    num_output_before = len(request.output_token_ids)
    block_ids_before = list(blocks(request.request_id)[0])

    scheduler_output = scheduler.schedule()  # books 1 + drafts; counts them all as computed
    booked = request.num_computed_tokens
    num_scheduled = scheduler_output.num_scheduled_tokens.get(request.request_id, 0)
    drafts = list(scheduler_output.scheduled_spec_decode_tokens.get(request.request_id, []))
    core.model_executor.execute_model(scheduler_output)  # drafts are inputs like any token
    # No grammar bitmask: this prompt has none (and a request with one gets no drafts).
    model_output = core.model_executor.sample_tokens(None)  # the rejection sampler decides
    sampled = model_output.by_request().get(request.request_id, [])
    block_ids_after_schedule = list(blocks(request.request_id)[0])
    outputs = scheduler.update_from_output(scheduler_output, model_output)  # the roll-back
    llm.llm_engine.output_processor.process_outputs(outputs.outputs)
    core.post_step(model_executed=scheduler_output.total_num_scheduled_tokens > 0)  # next drafts

    num_accepted = len(sampled) - 1 if drafts and sampled else 0
    record = StepRecord(
        step=-1, num_computed_before=before, num_scheduled=num_scheduled, num_computed_booked=booked,
        num_computed_after=request.num_computed_tokens, last_known=last_known, drafts=drafts, sampled=sampled,
        num_accepted=num_accepted, num_rejected=len(drafts) - num_accepted,
        num_appended=len(request.output_token_ids) - num_output_before,
        finish_reason=request.get_finished_reason(),
    )
    return record, {"block_ids_before": block_ids_before, "block_ids_after": block_ids_after_schedule}


def _k_rows(runner: ModelRunner, slots: list[SlotRecord]) -> list[torch.Tensor]:
    """Layer 0's K of each slot: kv_caches[0] is [2 (K, V), blocks, block_size, heads, head_dim]."""
    return [runner.kv_caches[0][0, slot.block_id, slot.offset].clone() for slot in slots]


def rejection_view(llm: LLM, request: Request, record: StepRecord, info: dict[str, Any]) -> RejectionView:
    """The slots the step wrote, each verified or a rejected draft, and the cache's state after it."""
    core, _ = engine_parts(llm)
    block_size = core.kv_cache_config.block_size
    table = info["block_ids_after"]
    inputs = [record.last_known[-1], *record.drafts]
    slots = []
    for j, token in enumerate(inputs):
        position = record.num_computed_before + j
        block_id, offset = table[position // block_size], position % block_size
        fate = "verified" if j <= record.num_accepted else "rejected draft"
        slots.append(SlotRecord(position, token, "last known token" if j == 0 else f"draft d_{j - 1}",
                                block_id, offset, fate))
    manager_blocks = core.scheduler.kv_cache_manager.coordinator.get_blocks(request.request_id)[0]
    cached = [b.block_id for b in manager_blocks if b.block_hash is not None]
    draft_blocks = sorted({s.block_id for s in slots if s.role != "last known token"})
    return RejectionView(record.step, info["block_ids_before"], table, slots, cached, draft_blocks)


def steps_table(llm: LLM, steps: list[StepRecord], k: int) -> Table:
    piece = _piece_fn(llm)
    table = Table(title="one request, step by step")
    names = ", ".join(f"d_{j}" for j in range(k))
    table.caption = (f"drafts {names} from left to right, row j of the logits judging d_j; "
                     "verdict per draft: ✓ accepted, ✗ the first mismatch, - discarded after it; "
                     "num_computed_tokens: before the step -> booked by schedule() -> after the roll-back")
    for column in ("step", "last known tokens", "drafts booked", "verdict", "acc/rej", "tokens emitted",
                   "num_computed_tokens"):
        table.add_column(column)
    for s in steps:
        known = "".join(piece(t) for t in s.last_known)
        counts = ""
        if s.is_prefill:
            drafts, verdict = "", f"prefill, {s.num_scheduled} tokens"
            emitted = repr(piece(s.sampled[0])) if s.sampled else ""
        elif not s.drafts:
            drafts, verdict = "none (no match)", "plain decode"
            emitted = " ".join(repr(piece(t)) for t in s.sampled)
        else:
            drafts = " ".join(repr(piece(t)) for t in s.drafts)
            marks = ["✓"] * s.num_accepted + (["✗"] if s.num_rejected else []) + ["-"] * max(s.num_rejected - 1, 0)
            verdict, counts = " ".join(marks), f"{s.num_accepted}/{s.num_rejected}"
            kept = " ".join(repr(piece(t)) for t in s.sampled[:-1])
            last = s.sampled[-1] if s.sampled else None
            kind = "bonus" if s.num_rejected == 0 else "recovered"
            emitted = (kept + " + " if kept else "") + (f"{piece(last)!r} ({kind})" if last is not None else "")
        dropped = s.sampled[s.num_appended:]
        if dropped:
            # The worker verified them, but the request ended first: said here,
            # so that the table's tokens add up to the answer's.
            cause = "past max_tokens" if s.finish_reason is FinishReason.LENGTH else "after the stop token"
            emitted += "; " + " ".join(repr(piece(t)) for t in dropped) + f" dropped: {cause}"
        table.add_row(str(s.step), repr(known), drafts, verdict, counts, emitted,
                      f"{s.num_computed_before} -> {s.num_computed_booked} -> {s.num_computed_after}")
    return table


def _piece_fn(llm: LLM) -> Any:
    tokenizer = llm.get_tokenizer()
    return lambda token_id: tokenizer.decode([token_id])


def print_rejection(llm: LLM, view: RejectionView, record: StepRecord) -> None:
    piece = _piece_fn(llm)
    added = [b for b in view.block_ids_after if b not in view.block_ids_before]
    console.print(
        f"step {view.step}: block table {view.block_ids_after}"
        + (f" ({added} added by this step's allocate_slots)" if added else " (no block added: the step fit)")
        + f"; num_computed_tokens {record.num_computed_before} -> booked {record.num_computed_booked} -> "
        f"rolled back to {record.num_computed_after}"
    )
    table = Table(title=f"the KV slots step {view.step} wrote")
    for column in ("position", "token fed", "role", "block", "offset", "after verification"):
        table.add_column(column)
    for slot in view.slots:
        table.add_row(str(slot.position), repr(piece(slot.token)), slot.role, str(slot.block_id),
                      str(slot.offset), slot.fate)
    console.print(table)
    rejected = [s.position for s in view.slots if s.fate == "rejected draft"]
    hashed_with_drafts = sorted(set(view.cached_block_ids) & set(view.draft_block_ids))
    console.print(
        f"after the roll-back: positions {rejected} hold the KV of rejected drafts, at or past "
        f"num_computed_tokens={record.num_computed_after}, so no attention reads them. Blocks in the prefix cache "
        f"(hashed): {view.cached_block_ids}; blocks holding a draft this step: {view.draft_block_ids}; "
        f"of those, cached: {hashed_with_drafts or 'none'}"
    )
    if view.rewrites is None:
        console.print("the request finished with that step: its blocks were freed, stale slots and all")
        return
    parts = []
    for rewrite in view.rewrites:
        if rewrite.new_token is None:
            what = "not written (past seq_len: never read)"
        elif rewrite.new_token == rewrite.old_token:
            what = f"written again with the same token {piece(rewrite.new_token)!r}"
        else:
            what = f"overwritten with {piece(rewrite.new_token)!r}"
        parts.append(f"position {rewrite.position} {what}, layer 0's K changed: {rewrite.k_changed}")
    console.print(
        f"the next step (seq_len {view.next_step_seq_len}): " + "; ".join(parts)
        + f". Verified slots unchanged: {view.verified_unchanged}"
    )


def run_by_hand(llm: LLM, max_tokens: int) -> tuple[list[StepRecord], Request, RejectionView | None]:
    """Sections 1 and 2: one request, stepped by hand until it finishes."""
    core, runner = engine_parts(llm)
    engine = llm.llm_engine
    rendered = engine.renderer.render_chat([{"role": "user", "content": BY_HAND_PROMPT}])
    engine.add_rendered_request(REQUEST_ID, rendered, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    request = core.scheduler.requests[REQUEST_ID]
    steps: list[StepRecord] = []
    view: RejectionView | None = None
    watched: tuple[list[SlotRecord], list[torch.Tensor]] | None = None
    while core.scheduler.has_requests():
        record, info = step_by_hand(llm, request)
        if record.num_scheduled == 0:
            continue  # a step that only told the worker the request had finished
        record = replace(record, step=len(steps))
        steps.append(record)
        if watched is not None and view is not None:
            # The next step ran (even if it was the request's last, nothing reused the blocks yet).
            slots, k_before = watched
            changed = [not torch.equal(a, b) for a, b in zip(k_before, _k_rows(runner, slots))]
            fed = [record.last_known[-1], *record.drafts]  # the next step's inputs, from its first position
            view.rewrites = [
                Rewrite(slot.position, slot.token,
                        fed[slot.position - record.num_computed_before]
                        if slot.position - record.num_computed_before < len(fed) else None, k_changed)
                for slot, k_changed in zip(slots, changed) if slot.fate == "rejected draft"
            ]
            view.verified_unchanged = not any(c for c, s in zip(changed, slots) if s.fate == "verified")
            view.next_step_seq_len = record.num_computed_before + record.num_scheduled
            watched = None
        if view is None and record.num_rejected > 0:
            view = rejection_view(llm, request, record, info)
            if not request.is_finished():
                watched = (view.slots, _k_rows(runner, view.slots))
    return steps, request, view


# ---------------------------------------------------------------- section 3


def stats_table(stats: SpecDecodingStats) -> Table:
    table = Table(title="acceptance per draft position (SpecDecodingStats)")
    for column in ("position", "drafted", "accepted", "acceptance"):
        table.add_column(column, justify="right")
    for position, (drafted, accepted) in enumerate(
        zip(stats.num_draft_tokens_per_pos, stats.num_accepted_tokens_per_pos)
    ):
        rate = f"{accepted / drafted:.0%}" if drafted else "-"
        table.add_row(str(position), str(drafted), str(accepted), rate)
    return table


def _copy_stats(stats: SpecDecodingStats) -> SpecDecodingStats:
    return replace(stats, num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos),
                   num_draft_tokens_per_pos=list(stats.num_draft_tokens_per_pos))


# ---------------------------------------------------------------- section 4


def compare_speed(spec_llm: LLM, plain_llm: LLM, max_tokens: int, repeats: int) -> SpeedResult:
    """The same prompts on both engines, alternately, ``repeats`` times; the best time of each.

    Alternating spreads whatever else the machine is doing over both sides.
    """
    engines = {"plain": plain_llm, "ngram": spec_llm}
    steps_seen = {name: 0 for name in engines}
    for name, llm in engines.items():
        def count(output: Any, *_: Any, name: str = name) -> None:
            steps_seen[name] += output.total_num_scheduled_tokens > 0
        tap(engine_parts(llm)[0].scheduler, "schedule", after=count)
    conversations = [[{"role": "user", "content": prompt}] for prompt in SPEED_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for llm in engines.values():  # warm-up: first-call costs stay out of the timing
        llm.chat(conversations[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    stats = engine_parts(spec_llm)[0].scheduler.spec_decoding_stats
    assert stats is not None
    start_stats = _copy_stats(stats)
    best: dict[str, float] = {}
    texts: dict[str, list[str]] = {}
    num_tokens: dict[str, int] = {}
    steps: dict[str, int] = {}
    for _ in range(repeats):
        for name, llm in engines.items():
            steps_seen[name] = 0
            start = time.perf_counter()
            outputs = llm.chat(conversations, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            best[name] = min(seconds, best.get(name, seconds))
            texts[name] = [out.outputs[0].text for out in outputs]
            num_tokens[name] = sum(len(out.outputs[0].token_ids) for out in outputs)
            steps[name] = steps_seen[name]
    drafts = stats.num_drafts - start_stats.num_drafts
    accepted = stats.num_accepted_tokens - start_stats.num_accepted_tokens
    return SpeedResult(
        tok_per_s={name: num_tokens[name] / best[name] for name in engines},
        steps=steps,
        num_tokens=num_tokens["ngram"],
        same_text=texts["plain"] == texts["ngram"],
        mean_acceptance_length=1 + accepted / drafts if drafts else None,
        cpu=describe_cpu(),
    )


def speed_table(result: SpeedResult, k: int) -> Table:
    table = Table(title=f"{len(SPEED_PROMPTS)} prompts in one batch, greedy")
    for column in ("engine", "steps", "tokens", "tokens/s"):
        table.add_column(column, justify="right")
    for name, label in (("plain", "no speculation"), ("ngram", f"ngram, k={k}")):
        table.add_row(label, str(result.steps[name]), str(result.num_tokens), f"{result.tok_per_s[name]:.1f}")
    return table


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> Ch09Result:
    parser = base_parser(__doc__ or "", __name__)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3, help="drafts per request and step")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest suffix the n-gram search matches")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="longest suffix the n-gram search matches")
    parser.add_argument("--draft-length", choices=("fixed", "adaptive"), default="fixed",
                        help="fixed verifies every draft, so the step table shows every draft and repeats run "
                             "for run; adaptive is the engine's default, which verifies only the drafts expected "
                             "to pay for their rows (chapter 9, \"When speculation does not pay\")")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default) keeps greedy texts identical in practice; in bf16 a "
                             "(k+1)-token step rounds differently from a one-token step and may flip a near tie")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per engine in section 4 (best kept)")
    parser.add_argument("--skip-speed", action="store_true", help="skip section 4 (the side-by-side timing)")
    args = parser.parse_args(argv)

    spec_llm = LLM(args.model, speculative_config=spec_config(args), **engine_kwargs(args))
    console.rule("1. One request, step by step: drafts, verdicts, the roll-back")
    steps, request, view = run_by_hand(spec_llm, args.max_tokens)
    text = spec_llm.get_tokenizer().decode(request.output_token_ids, skip_special_tokens=True)
    console.print(steps_table(spec_llm, steps, args.num_speculative_tokens))
    verify_steps = [s for s in steps if s.drafts]
    num_tokens = len(request.output_token_ids)
    num_sampled = sum(len(s.sampled) for s in steps)
    # A last step may verify tokens past max_tokens: the table lists them, the answer does not.
    dropped = f" ({num_sampled} sampled, {num_tokens} kept)" if num_sampled != num_tokens else ""
    console.print(
        f"{len(steps)} steps for {num_tokens} tokens{dropped}: 1 prefill, {len(verify_steps)} with drafts, "
        f"{len(steps) - 1 - len(verify_steps)} plain decodes (without speculation: {num_tokens} steps, one per token)"
    )
    console.print(f"text: {text!r}")

    console.rule("2. The KV blocks around a rejection")
    if view is None:
        console.print("no draft was rejected in this run: nothing to roll back")
    else:
        print_rejection(spec_llm, view, steps[view.step])

    console.rule("3. Acceptance per position and the mean acceptance length")
    live = engine_parts(spec_llm)[0].scheduler.spec_decoding_stats
    assert live is not None
    stats = _copy_stats(live)
    console.print(stats_table(stats))
    rate, mean = stats.acceptance_rate, stats.mean_acceptance_length
    console.print(
        f"{stats.num_drafts} verification steps, {stats.num_draft_tokens} drafts, {stats.num_accepted_tokens} "
        f"accepted: acceptance rate {'-' if rate is None else f'{rate:.0%}'}, mean acceptance length "
        f"{'-' if mean is None else f'{mean:.2f}'} tokens per verification step (1 + accepted / verification steps)"
    )

    result = Ch09Result(steps, text, list(request.output_token_ids), view, stats)
    if not args.skip_speed:
        console.rule("4. Speed: the same prompts with and without speculation")
        plain_llm = LLM(args.model, **engine_kwargs(args))
        speed = compare_speed(spec_llm, plain_llm, args.max_tokens, args.repeats)
        console.print(speed_table(speed, args.num_speculative_tokens))
        mean_text = "-" if speed.mean_acceptance_length is None else f"{speed.mean_acceptance_length:.2f}"
        console.print(
            f"ngram / plain: {speed.ratio:.2f}x tokens/s (best of {args.repeats} runs each, {args.dtype}); "
            f"mean acceptance length {mean_text}\n{speed.cpu}\n"
            f"greedy texts identical with and without speculation: {speed.same_text}"
        )
        plain_llm.llm_engine.shutdown()
        result.speed = speed
    spec_llm.llm_engine.shutdown()
    return result


if __name__ == "__main__":
    main()
