"""Chapter 9's draft-length policy: which drafts are worth their rows, and vLLM's batch-size table.

Pure bookkeeping, no model: the policy is fed step times and verification
results by hand, and its choice is compared with every other choice under the
same cost model.
"""

from __future__ import annotations

import itertools

import pytest

from nanoengine.config import SpeculativeConfig
from nanoengine.spec_decode.draft_length import (
    AcceptanceEstimate,
    DraftLengthPolicy,
    StepCostModel,
    cap_for_batch,
)


def policy_with_cost(start: float, per_row: float, max_drafts: int = 5) -> DraftLengthPolicy:
    policy = DraftLengthPolicy(max_drafts)
    for rows in range(1, 60):
        policy.observe_step(rows, start + per_row * rows)
    return policy


def teach(policy: DraftLengthPolicy, req_id: str, kept: int, drafted: int, steps: int = 30) -> None:
    for _ in range(steps):
        policy.observe_verified(req_id, drafted, kept)


def tokens_per_second(lengths: list[int], rates: list[float], start: float, per_row: float) -> float:
    tokens = len(lengths) + sum(sum(rate**j for j in range(1, n + 1)) for n, rate in zip(lengths, rates))
    return tokens / (start + per_row * (len(lengths) + sum(lengths)))


def test_every_draft_is_verified_until_two_row_counts_were_timed() -> None:
    policy = DraftLengthPolicy(3)
    assert policy.choose(["a", "b"], [3, 2]) == [3, 2]
    policy.observe_step(2, 0.02)
    assert policy.choose(["a", "b"], [3, 2]) == [3, 2]  # one row count: no slope yet


def test_the_cost_line_is_fitted_to_the_rows_near_the_step() -> None:
    cost = StepCostModel()
    for rows, seconds in [(1, 0.020), (4, 0.026), (32, 0.100), (40, 0.120)]:
        cost.observe(rows, seconds)
    start, per_row = cost.line(1, 4) or (0.0, 0.0)
    assert per_row == pytest.approx(0.002) and start == pytest.approx(0.018)
    assert cost.line(100, 200) is not None  # nothing in range: every row count seen


@pytest.mark.parametrize(("start", "per_row"), [(0.020, 0.0015), (0.017, 0.0028), (0.010, 0.010)])
def test_the_choice_beats_every_other_choice_under_the_cost_model(start: float, per_row: float) -> None:
    policy = policy_with_cost(start, per_row, max_drafts=3)
    for req_id, kept in zip("abc", (3, 1, 0)):
        teach(policy, req_id, kept, 3)
    rates = [policy.acceptance_rate(r) for r in "abc"]
    chosen = policy.choose(list("abc"), [3, 3, 2])
    best = max(tokens_per_second(list(c), rates, start, per_row)
               for c in itertools.product(range(4), range(4), range(3)))
    assert tokens_per_second(chosen, rates, start, per_row) == pytest.approx(best, rel=1e-3)


def test_poor_drafts_are_cut_where_rows_are_dear_and_kept_where_they_are_cheap() -> None:
    # Batch 8 on two cores: a row costs about half of one token's share of the step.
    dear = policy_with_cost(0.017, 0.0028)
    cheap = policy_with_cost(0.025, 0.0015)  # batch 1: a row is a small part of the step
    for policy in (dear, cheap):
        teach(policy, "poor", 1, 5)  # keeps one draft in five, then misses
        teach(policy, "good", 5, 5)
    req_ids = ["poor", "good", *(f"new{i}" for i in range(6))]
    dear_choice = dear.choose(req_ids, [5] * 8)
    assert dear_choice[0] == 0 and dear_choice[1] == 5
    assert cheap.choose(["poor"], [5])[0] >= 1


def test_a_request_without_drafts_returns_to_the_engine_wide_rate() -> None:
    policy = policy_with_cost(0.025, 0.0015)
    teach(policy, "other", 4, 4, steps=40)
    teach(policy, "r", 0, 4, steps=10)
    low = policy.acceptance_rate("r")
    for _ in range(40):
        policy.choose(["r"], [0])  # no drafts proposed: no new evidence, only fading
    assert low < 0.2 < policy.acceptance_rate("r")
    assert policy.acceptance_rate("r") == pytest.approx(policy.acceptance_rate("never seen"), abs=0.1)


def test_acceptance_counts_only_the_drafts_that_were_judged() -> None:
    estimate = AcceptanceEstimate()
    estimate.observe(num_drafted=4, num_accepted=1)  # d_1 rejected, d_2 and d_3 never judged
    estimate.observe(num_drafted=2, num_accepted=2)
    assert (estimate.kept, estimate.rejected) == (3, 1)
    assert estimate.rate(prior=0.5, prior_weight=0.0) == 0.75


@pytest.mark.parametrize(("batch", "expected"), [(1, 3), (16, 3), (17, 3), (31, 3), (32, 2), (128, 2), (300, 2)])
def test_vllms_batch_size_table_fills_gaps_and_the_tail_with_the_range_before(batch: int, expected: int) -> None:
    assert cap_for_batch([(1, 16, 3), (32, 128, 2)], batch, max_drafts=5) == expected


def test_the_batch_size_table_never_raises_the_draft_length() -> None:
    assert cap_for_batch([(1, 4, 9)], 2, max_drafts=3) == 3


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], "non-empty list"),
        ([(2, 8, 3)], "start at batch size 1"),
        ([(1, 8, 3), (8, 16, 2)], "overlap"),
        ([(1, 8, -1)], "num_speculative_tokens >= 0"),
        ([(1, 8)], "three ints"),
        ([(4, 1, 2)], "first_batch_size <= last_batch_size"),
    ],
)
def test_a_bad_batch_size_table_is_refused_by_name(schedule: list[tuple[int, ...]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=schedule)  # type: ignore[arg-type]


def test_draft_length_names_its_two_choices() -> None:
    with pytest.raises(ValueError, match="'adaptive' or 'fixed'"):
        SpeculativeConfig(draft_length="sometimes")  # type: ignore[arg-type]
    config = SpeculativeConfig(num_speculative_tokens_per_batch_size=[[1, 4, 3], [5, 64, 0]])  # type: ignore[list-item]
    assert config.num_speculative_tokens_per_batch_size == [(1, 4, 3), (5, 64, 0)]


def test_a_request_without_evidence_probes_its_first_draft_where_rows_are_dear() -> None:
    # An engine that doubts every draft (prior 0.5) at a cost where only a draft
    # kept more often than not pays: without the probe nothing is ever tried.
    policy = policy_with_cost(0.017, 0.0028)
    req_ids = [f"r{i}" for i in range(8)]
    assert policy.choose(req_ids, [3] * 8) == [1] * 8
    for req_id in req_ids:
        policy.observe_verified(req_id, 1, 0)  # every probe rejected
    assert policy.choose(req_ids, [3] * 8) == [0] * 8
    steps = 1
    while policy.choose(req_ids, [3] * 8) == [0] * 8:
        steps += 1
    assert 15 <= steps <= 25  # tried again once the rejections faded
