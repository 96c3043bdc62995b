"""The chapter-8 sampler ops, each against its plain per-row reference.

logit_bias, repetition/frequency/presence penalties, min_p and logprobs are
written batched (one scatter, one where, one topk); each has a slow, obviously
correct loop next to it in the source, and the two must agree. Neutral values
must leave the logits bit for bit as they were, and a batch that asks for none
of these keeps the sampler's all-greedy fast path.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoengine.sample import sampler as sampler_module
from nanoengine.sample.metadata import SamplingMetadata
from nanoengine.sample.penalties import (
    PenaltyInputs,
    apply_penalties,
    apply_penalties_reference,
    pad_token_ids,
)
from nanoengine.sample.sampler import (
    Sampler,
    apply_logit_bias,
    apply_logit_bias_reference,
    apply_min_p,
    apply_min_p_reference,
    compute_logprobs,
    gather_logprobs,
    gather_logprobs_reference,
)

VOCAB = 50
ROWS = 6


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)


def _random_token_lists(max_len: int) -> list[list[int]]:
    # Repeats on purpose: frequency counts them, presence and repetition do not.
    return [[random.randrange(VOCAB) for _ in range(random.randrange(max_len + 1))] for _ in range(ROWS)]


def _penalties(presence: list[float], frequency: list[float], repetition: list[float]) -> PenaltyInputs:
    return PenaltyInputs(
        prompt_token_ids=pad_token_ids(_random_token_lists(12), pad_id=VOCAB),
        output_token_ids=pad_token_ids(_random_token_lists(20), pad_id=VOCAB),
        presence_penalties=torch.tensor(presence),
        frequency_penalties=torch.tensor(frequency),
        repetition_penalties=torch.tensor(repetition),
    )


def _greedy_metadata(num_rows: int, **extra: object) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(num_rows),
        top_p=torch.ones(num_rows),
        top_k=torch.full((num_rows,), VOCAB),
        greedy_mask=torch.ones(num_rows, dtype=torch.bool),
        all_greedy=True,
        no_top_p=True,
        no_top_k=True,
        **extra,  # type: ignore[arg-type]
    )


def test_penalties_match_the_reference() -> None:
    logits = torch.randn(ROWS, VOCAB) * 3
    logits[0, :5] = float("-inf")  # banned tokens stay banned
    inputs = _penalties(
        presence=[0.0, 0.5, -1.0, 2.0, 0.3, 0.0],
        frequency=[0.0, 0.25, 1.5, -2.0, 0.0, 0.7],
        repetition=[1.0, 1.3, 0.8, 2.0, 1.0, 1.1],
    )
    fast = apply_penalties(logits, inputs)
    assert torch.allclose(fast, apply_penalties_reference(logits, inputs), atol=1e-6)
    assert fast[0, :5].eq(float("-inf")).all()


def test_penalties_pad_only_short_rows() -> None:
    padded = pad_token_ids([[3, 3], [], [1, 2, 4]], pad_id=VOCAB)
    assert padded.tolist() == [[3, 3, VOCAB], [VOCAB] * 3, [1, 2, 4]]
    assert pad_token_ids([[], []], pad_id=VOCAB).shape == (2, 0)


def test_neutral_penalties_change_nothing() -> None:
    logits = torch.randn(ROWS, VOCAB)
    inputs = _penalties(presence=[0.0] * ROWS, frequency=[0.0] * ROWS, repetition=[1.0] * ROWS)
    assert torch.equal(apply_penalties(logits, inputs), logits)


def test_repetition_penalty_makes_seen_tokens_less_likely_either_sign() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    inputs = PenaltyInputs(
        prompt_token_ids=torch.tensor([[0]]),
        output_token_ids=torch.tensor([[1, 1]]),
        presence_penalties=torch.zeros(1),
        frequency_penalties=torch.zeros(1),
        repetition_penalties=torch.tensor([2.0]),
    )
    assert apply_penalties(logits, inputs).tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_frequency_counts_output_only_presence_once() -> None:
    logits = torch.zeros(1, 4)
    inputs = PenaltyInputs(
        prompt_token_ids=torch.tensor([[3, 3, 3]]),  # the prompt does not count for these two
        output_token_ids=torch.tensor([[1, 1, 1, 2]]),
        presence_penalties=torch.tensor([0.5]),
        frequency_penalties=torch.tensor([1.0]),
        repetition_penalties=torch.ones(1),
    )
    assert apply_penalties(logits, inputs).tolist() == [[0.0, -3.5, -1.5, 0.0]]


def test_logit_bias_matches_the_reference() -> None:
    logits = torch.randn(ROWS, VOCAB)
    bias = {0: {3: 5.0, 49: -100.0}, 2: {0: 1.5}, 5: {3: -2.0, 4: 0.25, 10: 100.0}}
    fast = apply_logit_bias(logits, bias)
    assert torch.allclose(fast, apply_logit_bias_reference(logits, bias))
    assert not torch.equal(fast, logits) and apply_logit_bias(logits, {}) is logits


def test_min_p_matches_the_reference() -> None:
    logits = torch.randn(ROWS, VOCAB) * 2
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.5, 0.9, 1.0])
    fast = apply_min_p(logits, min_p)
    assert torch.equal(fast.isinf(), apply_min_p_reference(logits, min_p).isinf())
    assert torch.equal(fast[0], logits[0])  # min_p = 0 keeps the row
    assert fast[-1].isfinite().sum() == 1  # min_p = 1 keeps only the most likely
    assert (fast.argmax(-1) == logits.argmax(-1)).all()


def test_gather_logprobs_matches_the_reference() -> None:
    logprobs = compute_logprobs(torch.randn(ROWS, VOCAB) * 2)
    chosen = torch.tensor([0, 7, 49, 12, 3, 30])
    chosen[1] = int(logprobs[1].argmax())
    for k in (0, 1, 5, 20):
        fast, slow = gather_logprobs(logprobs, k, chosen), gather_logprobs_reference(logprobs, k, chosen)
        assert torch.equal(fast.logprob_token_ids, slow.logprob_token_ids)
        assert torch.allclose(fast.logprobs, slow.logprobs)
        assert torch.equal(fast.selected_token_ranks, slow.selected_token_ranks)
    assert int(gather_logprobs(logprobs, 2, chosen).selected_token_ranks[1]) == 1


def test_logprobs_lists_keep_what_each_request_asked_for() -> None:
    tensors = gather_logprobs(compute_logprobs(torch.randn(3, VOCAB)), 4, torch.tensor([1, 2, 3]))
    lists = tensors.tolists(1, 3, num_logprobs=2)
    assert len(lists) == 2 and all(len(row) == 3 for row in lists.logprob_token_ids)
    assert lists.logprob_token_ids[0][0] == 2


def test_logprobs_are_taken_from_the_raw_logits() -> None:
    """Bias, penalties and temperature change the token, never its reported logprob."""
    logits = torch.randn(ROWS, VOCAB)
    md = _greedy_metadata(
        ROWS,
        logit_bias={row: {row + 10: 50.0} for row in range(ROWS)},
        penalties=_penalties(presence=[1.0] * ROWS, frequency=[0.5] * ROWS, repetition=[1.5] * ROWS),
        max_num_logprobs=3,
    )
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [row + 10 for row in range(ROWS)]
    assert out.logprobs_tensors is not None
    expected = gather_logprobs(logits.log_softmax(-1), 3, out.sampled_token_ids)
    assert torch.equal(out.logprobs_tensors.logprob_token_ids, expected.logprob_token_ids)
    assert torch.allclose(out.logprobs_tensors.logprobs, expected.logprobs)


def test_greedy_takes_the_argmax_after_penalties() -> None:
    logits = torch.randn(ROWS, VOCAB)
    penalties = _penalties(presence=[2.0] * ROWS, frequency=[2.0] * ROWS, repetition=[3.0] * ROWS)
    out = Sampler()(logits, _greedy_metadata(ROWS, penalties=penalties))
    assert torch.equal(out.sampled_token_ids, apply_penalties_reference(logits, penalties).argmax(-1))


def test_all_greedy_fast_path_runs_nothing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("the all-greedy fast path ran an op it does not need")

    for name in ("compute_logprobs", "apply_penalties", "apply_min_p", "apply_top_k_top_p", "random_sample"):
        monkeypatch.setattr(sampler_module, name, forbidden)
    logits = torch.randn(ROWS, VOCAB)
    out = Sampler()(logits, _greedy_metadata(ROWS))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.logprobs_tensors is None


def test_seeded_sampling_with_every_option_replays() -> None:
    logits = torch.randn(ROWS, VOCAB)

    def draw() -> list[int]:
        random.seed(0)  # the same penalty inputs each time
        md = SamplingMetadata(
            temperature=torch.full((ROWS,), 0.9),
            top_p=torch.full((ROWS,), 0.9),
            top_k=torch.full((ROWS,), 20),
            greedy_mask=torch.zeros(ROWS, dtype=torch.bool),
            all_greedy=False,
            no_top_p=False,
            no_top_k=False,
            generators={row: torch.Generator().manual_seed(row) for row in range(ROWS)},
            logit_bias={0: {1: 3.0}},
            penalties=_penalties(presence=[0.5] * ROWS, frequency=[0.5] * ROWS, repetition=[1.2] * ROWS),
            min_p=torch.full((ROWS,), 0.05),
            max_num_logprobs=2,
        )
        return Sampler()(logits, md).sampled_token_ids.tolist()

    assert draw() == draw()
