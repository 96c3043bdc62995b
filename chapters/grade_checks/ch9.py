"""The grader's checks for exercise 9.1 (chapter 9): greedy verification of drafts.

Each promise on the exercise page has a check of its own, named in a
student's words. The unit checks call ``_verify_greedy(drafts, rows)``
directly, on score rows built here: random logits (negative ones too) in
which each row's best token is planted, so a label can say what the target
prefers at every position. Their inputs are chosen so that each classic
mistake is first named by the check of the behaviour it breaks
(tests/exercise_mutants/ch9.py plants them). A batched check then goes
through ``rejection_sample``, the function that cuts a batch's scores into
each request's rows and calls the student's code, and the end-to-end run
decodes with n-gram drafts and requires the tokens of plain greedy decoding.
That the reference's run meets every case of the page (drafts kept, drafts
rejected, a step that kept all its drafts, fewer steps than plain decoding)
is asserted by tests/test_exercises.py, not here: an assert in the check
would hide, from a student, the fields that differ.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from chapters.grade_checks.common import SMALL_BLOCKS, Check
from chapters.grade_messages import Label
from nanoengine import LLM, SamplingParams
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.sample.rejection_sampler import _verify_greedy, rejection_sample

# The unit checks' vocabulary: small enough that labels stay short, large
# enough that a random draft is usually wrong.
VOCAB = 16


def scores(argmaxes: Sequence[int], seed: int = 0, ties: dict[int, int] | None = None) -> torch.Tensor:
    """Float [len(argmaxes), VOCAB] logits, row j's highest score at ``argmaxes[j]``.

    The rest of each row is standard normal noise, so scores are negative as
    well as positive; the planted best is 1.0 above the noise. ``ties`` maps a
    row to a second token given exactly the same best score.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(argmaxes), VOCAB, generator=generator)
    for j, token in enumerate(argmaxes):
        best = float(rows[j].max()) + 1.0
        rows[j, token] = best
        if ties is not None and j in ties:
            rows[j, ties[j]] = best
    return rows


def as_tokens(result: Any) -> Any:
    """The emitted tokens as plain ints, whatever container they came in (types have a check of their own)."""
    if isinstance(result, torch.Tensor):
        return result.tolist()
    if isinstance(result, list | tuple):
        return [int(t) if isinstance(t, torch.Tensor) and t.numel() == 1 else t for t in result]
    return result


def verify(drafts: list[int], argmaxes: list[int], seed: int = 0) -> tuple[str, Any]:
    """One labeled call: ``drafts`` against rows whose argmaxes are ``argmaxes``."""
    assert len(argmaxes) == len(drafts) + 1, "a request with k drafts has k + 1 rows"
    return rows_label(drafts, argmaxes), as_tokens(_verify_greedy(list(drafts), scores(argmaxes, seed)))


def rows_label(drafts: list[int], argmaxes: list[int], what: str = "", what_zh: str = "") -> Label:
    """"drafts [4, 9], argmax of each row [4, 9, 2]", in both languages, ``what`` after a colon."""
    return Label(f"drafts {drafts}, argmax of each row {argmaxes}" + (f": {what}" if what else ""),
                 f"草稿 {drafts}，各行的 argmax {argmaxes}" + (f"：{what_zh}" if what_zh else ""))


def _type_name(value: Any) -> str:
    # Type names only: they read the same in both languages.
    if isinstance(value, torch.Tensor):
        return f"torch.Tensor({value.dtype})"
    return type(value).__name__


# ------------------------------------------------------ 9.1 _verify_greedy
def python_ints(model: str) -> dict[str, Any]:
    """Drafts `[4, 9]` against rows whose argmaxes are `[4, 9, 2]` (both kept), then `[4, 5, 2]`
    (`d_1` rejected): the type of the result and the types of the tokens in it.
    """
    table: dict[str, Any] = {}
    for argmaxes in ([4, 9, 2], [4, 5, 2]):
        result = _verify_greedy([4, 9], scores(argmaxes))
        table[rows_label([4, 9], argmaxes, "the type returned", "返回值的类型")] = _type_name(result)
        items = result if isinstance(result, list | tuple) else []
        table[rows_label([4, 9], argmaxes, "the types of its tokens", "其中 token 的类型")] = sorted(
            {_type_name(t) for t in items})
    return table


def rejected_draft(model: str) -> dict[str, Any]:
    """Drafts `[3, 8]` against argmaxes `[5, 6, 1]` and `[7, 7, 7]` against `[2, 9, 9, 9]` (`d_0`
    is wrong); `[4, 4, 3]` against `[4, 4, 4, 6]` (`d_2` is wrong).
    """
    return dict(verify(d, a) for d, a in (([3, 8], [5, 6, 1]), ([7, 7, 7], [2, 9, 9, 9]), ([4, 4, 3], [4, 4, 4, 6])))


def draft_j_against_row_j(model: str) -> dict[str, Any]:
    """Drafts `[5, 9]` against argmaxes `[4, 5, 9]`, `[4, 9]` against `[4, 5, 9]`, and `[6]`
    against `[2, 6]`: a draft that is wrong for its own row is the argmax of the next row.
    """
    return dict(verify(d, a) for d, a in (([5, 9], [4, 5, 9]), ([4, 9], [4, 5, 9]), ([6], [2, 6])))


def matching_prefix_only(model: str) -> dict[str, Any]:
    """Drafts `[3, 5, 8]` against argmaxes `[3, 6, 8, 2]` and `[1, 2, 3, 4]` against
    `[9, 2, 3, 4, 5]`: drafts after the first wrong one match their rows.
    """
    return dict(verify(d, a) for d, a in (([3, 5, 8], [3, 6, 8, 2]), ([1, 2, 3, 4], [9, 2, 3, 4, 5])))


def bonus_token(model: str) -> dict[str, Any]:
    """Drafts `[4, 9, 2]` against argmaxes `[4, 9, 2, 6]` and `[11]` against `[11, 3]`: every draft
    is the target's choice.
    """
    return dict(verify(d, a) for d, a in (([4, 9, 2], [4, 9, 2, 6]), ([11], [11, 3])))


def no_drafts(model: str) -> dict[str, Any]:
    """No drafts (`[]`) against one row whose argmax is `7`, and against one whose argmax is `0`."""
    return dict(verify([], a, seed) for seed, a in enumerate(([7], [0])))


def ties(model: str) -> dict[str, Any]:
    """Row 0 gives tokens `2` and `5` the same best score (row 1's argmax is `7`): drafts `[5]`,
    then `[2]`; and row 1 gives tokens `3` and `12` the same best score after a kept draft `[9]`:
    drafts `[9, 12]`.
    """
    table: dict[str, Any] = {}
    for drafts, argmaxes, tie in (([5], [2, 7], {0: 5}), ([2], [2, 7], {0: 5}), ([9, 12], [9, 3, 1], {1: 12})):
        rows = scores(argmaxes, ties=tie)
        row, other = next(iter(tie.items()))
        assert int(rows[row].argmax()) == argmaxes[row], "torch's argmax takes the first of equal scores"
        shared = sorted((argmaxes[row], other))
        label = Label(f"drafts {drafts}, row {row}'s best score shared by tokens {shared[0]} and {shared[1]}",
                      f"草稿 {drafts}，第 {row} 行的最高分由 token {shared[0]} 和 {shared[1]} 并列")
        table[label] = as_tokens(_verify_greedy(list(drafts), rows))
    return table


def random_batches(model: str) -> dict[str, Any]:
    """Twelve batches of 3 requests, each with 0 to 4 drafts, through `rejection_sample(drafts,
    scores, greedy=[True] * 3)`: each draft is its row's argmax with probability 0.7, and the
    batch's scores are one float `[sum(k_i + 1), 16]` tensor (seeded: the same every run).
    """
    rng = random.Random(9)
    table: dict[str, Any] = {}
    for batch in range(12):
        drafts: list[list[int]] = []
        argmaxes: list[list[int]] = []
        for _ in range(3):
            k = rng.randrange(5)
            best = [rng.randrange(VOCAB) for _ in range(k + 1)]
            drafts.append([b if rng.random() < 0.7 else rng.randrange(VOCAB) for b in best[:k]])
            argmaxes.append(best)
        logits = torch.cat([scores(best, seed=100 * batch + i) for i, best in enumerate(argmaxes)])
        emitted = rejection_sample(drafts, logits, [True] * 3)
        label = Label(f"batch {batch}: drafts {drafts}, argmax of each row {argmaxes}",
                      f"第 {batch} 个 batch：草稿 {drafts}，各行的 argmax {argmaxes}")
        table[label] = [as_tokens(e) for e in emitted]
    return table


# ------------------------------------------------------------- end to end
# Prompts of one repeated token: on the grader's tiny model and on SmolLM2 the
# greedy answers repeat themselves in places and wander in others, so the
# n-gram proposer's drafts are kept, rejected, and sometimes kept whole.
SPEC_PROMPTS = [[160] * 3, [230] * 3, [40] * 3, [280] * 3]
SPEC_MAX_TOKENS = 24
# Every draft verified (draft_length="fixed"): the adaptive default drops drafts
# by measured step times, and the counts below must be the same on every run.
NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3, "draft_length": "fixed"}
# Plain decoding finishes in SPEC_MAX_TOKENS steps, and every step emits at
# least one token per request. A verification that emits nothing would keep
# the engine stepping forever: the run stops here and says so.
MAX_STEPS = 4 * SPEC_MAX_TOKENS


@dataclass(frozen=True)
class SpecRun:
    """What one greedy run of ``SPEC_PROMPTS`` produced, and how."""

    token_ids: list[list[int]]
    steps: int  # engine steps until every request finished (MAX_STEPS: it never did)
    finished: bool
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_all_kept: int = 0  # steps of a request that kept all of its NGRAM drafts


def _generate(model: str, **engine_kwargs: Any) -> SpecRun:
    """Step a fresh engine through ``SPEC_PROMPTS`` (at most ``MAX_STEPS`` steps), greedily."""
    llm = LLM(model=model, **SMALL_BLOCKS, **engine_kwargs)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=SPEC_MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(SPEC_PROMPTS):
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=prompt), params)
    tokens: dict[str, list[int]] = {str(index): [] for index in range(len(SPEC_PROMPTS))}
    steps = 0
    while engine.has_unfinished_requests() and steps < MAX_STEPS:
        for output in engine.step():  # cumulative outputs: the latest holds every token so far
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
    finished = not engine.has_unfinished_requests()
    stats = engine.engine_core.get_engine_core().scheduler.spec_decoding_stats
    engine.shutdown()
    run = SpecRun(list(tokens.values()), steps, finished)
    if stats is None:
        return run
    return replace(run, num_draft_tokens=stats.num_draft_tokens, num_accepted_tokens=stats.num_accepted_tokens,
                   num_all_kept=stats.num_accepted_tokens_per_pos[-1])


@functools.cache
def plain_run(model: str) -> SpecRun:
    """What plain greedy decoding gives (no drafts: the verification is never called)."""
    return _generate(model)


def e2e_same_as_plain(model: str) -> dict[str, Any]:
    """Four prompts of one repeated token (`[160] * 3`, `[230] * 3`, `[40] * 3`, `[280] * 3`), 24
    greedy tokens each, with n-gram drafts of up to 3 tokens (`prompt_lookup_min=1`,
    `prompt_lookup_max=3`); and the same without speculation.
    """
    plain, spec = plain_run(model), _generate(model, speculative_config=NGRAM)
    # The summary first: a failure lists at most a dozen differing places.
    k = NGRAM["num_speculative_tokens"]
    table: dict[str, Any] = {
        Label(f"every request finished within {MAX_STEPS} engine steps",
              f"每个请求都在 {MAX_STEPS} 个引擎步以内完成"): spec.finished,
        Label("every request's tokens are plain greedy decoding's",
              "每个请求的 token 都和普通贪心解码的一样"): spec.token_ids == plain.token_ids,
        Label("drafted tokens verified", "验证过的草稿 token 数"): spec.num_draft_tokens,
        Label("drafts kept", "留下的草稿数"): spec.num_accepted_tokens,
        Label(f"steps that kept all {k} drafts (and added a bonus token)",
              f"{k} 个草稿全部留下（并补上 bonus token）的步数"): spec.num_all_kept,
        Label(f"engine steps (plain decoding: {plain.steps})",
              f"引擎步数（普通贪心解码：{plain.steps}）"): spec.steps,
    }
    for prompt, token_ids in zip(SPEC_PROMPTS, spec.token_ids):
        label = Label(f"a prompt that repeats token {prompt[0]} {len(prompt)} times, up to {k} drafts proposed "
                      "each step: the tokens",
                      f"把 token {prompt[0]} 重复 {len(prompt)} 次的 prompt，每步最多提议 {k} 个草稿：生成的 token")
        table[label] = token_ids
    return table


CHECKS: dict[str, tuple[Check, ...]] = {
    "9.1": (Check("returns a list of Python ints", python_ints),
            Check("a rejected draft: the target's token takes its place, and the step ends there", rejected_draft),
            Check("draft d_j is judged by row j, not row j + 1", draft_j_against_row_j),
            Check("only the matching prefix is kept: a later draft that matches does not count",
                  matching_prefix_only),
            Check("every draft kept: the drafts, then the bonus token of the last row", bonus_token),
            Check("no drafts: the target's own token alone", no_drafts),
            Check("a tie goes to the lowest token id, as the sampler's argmax", ties),
            Check("random batches of drafts, through rejection_sample", random_batches),
            Check("end to end: n-gram drafts give the tokens of plain greedy decoding", e2e_same_as_plain)),
}
