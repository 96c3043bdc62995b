"""Chapter 9's parts that stand alone: SpeculativeConfig, the n-gram proposer, the rejection sampler.

The proposer's numpy search is held to its loop reference over random token
sequences (hypothesis). The rejection sampler is checked two ways: greedy
verification emits exactly the target's argmaxes, and with temperature the
first emitted token follows the target's distribution -- a chi-square test
over 40,000 seeded draws per case, with the 1e-4 quantile of chi-square as the
bound (a correct sampler fails with probability 1e-4 for a fresh seed; the
seed is fixed, so the outcome is the same on every run).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoengine.config import SpeculativeConfig
from nanoengine.sample.rejection_sampler import rejection_sample
from nanoengine.spec_decode.ngram_proposer import NgramProposer, find_ngram_draft, find_ngram_draft_reference

# Chi-square quantiles at 1 - 1e-4, by degrees of freedom (from the chi-square table).
CHI2_1E4 = {3: 21.108, 5: 25.745}


@pytest.mark.parametrize(
    ("kwargs", "bounds"),
    [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 2}, (2, 2)),
     ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4))],
)
def test_lookup_bounds_follow_vllms_defaults(kwargs: dict[str, int], bounds: tuple[int, int]) -> None:
    config = SpeculativeConfig(method="ngram", **kwargs)  # type: ignore[arg-type]
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == bounds


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
     ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
     ({"method": "draft_model"}, "needs model")],
)
def test_bad_speculative_configs_are_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig(**kwargs)  # type: ignore[arg-type]


def test_the_ngram_proposer_copies_what_followed_the_longest_earlier_match() -> None:
    the, cat, sat, on, mat, dot = range(6)
    tokens = [the, cat, sat, on, the, mat, dot, the, cat, sat, on]
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                               prompt_lookup_max=4), max_model_len=64)
    # "the cat sat on" (n = 4) occurred at 0: propose what followed it.
    assert proposer.propose([tokens]) == [[the, mat, dot]]
    # No suffix of length >= 2 occurs earlier: nothing to propose.
    strict = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3), max_model_len=64)
    assert strict.propose([[1, 2, 3, 4, 5]]) == [[]]
    # The context's end caps the draft: one position left before max_model_len.
    assert NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=4),
                         max_model_len=len(tokens) + 1).propose([tokens]) == [[the]]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), min_n=st.integers(1, 4),
       extra=st.integers(0, 3), k=st.integers(0, 5))
def test_the_numpy_search_equals_the_loop_reference(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    fast = find_ngram_draft(np.asarray(tokens, dtype=np.int64), min_n, min_n + extra, k)
    assert fast.tolist() == find_ngram_draft_reference(tokens, min_n, min_n + extra, k)


def _one_hot_rows(argmaxes: list[int], vocab: int) -> torch.Tensor:
    rows = torch.full((len(argmaxes), vocab), 0.01)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.9
    return rows


def test_greedy_verification_keeps_the_agreeing_prefix_then_takes_the_targets_token() -> None:
    vocab = 8
    # Request 0: target argmaxes 3 4 5 | bonus 6; drafts 3 4 7 -> keep 3 4, then 5.
    # Request 1: all three drafts agree -> keep them and add the bonus 2.
    # Request 2: no drafts -> just the target's token.
    targets = _one_hot_rows([3, 4, 5, 6] + [1, 1, 1, 2] + [7], vocab)
    emitted = rejection_sample([[3, 4, 7], [1, 1, 1], []], targets, greedy=[True, True, True])
    assert emitted == [[3, 4, 5], [1, 1, 1, 2], [7]]


def _first_token_counts(p: torch.Tensor, q: torch.Tensor | None, draft_token: int | None, trials: int) -> torch.Tensor:
    """How often each token comes out first, over ``trials`` steps of one draft.

    With ``q``, the draft is drawn from it each trial (as a draft model would);
    without, the draft is always ``draft_token`` (an n-gram proposer's).
    """
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(len(p))
    bonus = torch.full_like(p, 1.0 / len(p))
    for _ in range(trials):
        token = int(torch.multinomial(q, 1, generator=generator)) if q is not None else draft_token
        assert token is not None
        rows = torch.stack([p, bonus])
        (emitted,) = rejection_sample([[token]], rows, greedy=[False],
                                      draft_probs=None if q is None else q.unsqueeze(0), generator=generator)
        counts[emitted[0]] += 1
    return counts


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("proposer", ["draft model", "n-gram"])
def test_with_temperature_the_first_token_follows_the_targets_distribution(proposer: str) -> None:
    p = torch.tensor([0.35, 0.05, 0.25, 0.10, 0.15, 0.10])
    q = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.05, 0.10]) if proposer == "draft model" else None
    counts = _first_token_counts(p, q, draft_token=1, trials=40_000)
    assert _chi_square(counts, p) < CHI2_1E4[len(p) - 1], counts / counts.sum()


def test_a_sampler_that_always_keeps_the_draft_is_caught() -> None:
    """The test has teeth: keeping every draft gives the draft's distribution, and chi-square sees it."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    generator = torch.Generator().manual_seed(1234)
    counts = torch.bincount(torch.multinomial(q, 40_000, replacement=True, generator=generator), minlength=4)
    assert _chi_square(counts.float(), p) > CHI2_1E4[len(p) - 1]
