"""Sampler semantics: greedy, top-k, top-p boundaries, seeds, banned ids, mixed rows."""

from __future__ import annotations

import pytest
import torch

from nanoengine.sample.metadata import SamplingMetadata
from nanoengine.sample.sampler import Sampler, apply_top_k_top_p

VOCAB = 8


def metadata(
    num_rows: int,
    *,
    temperature: float = 1.0,
    top_k: int = VOCAB,
    top_p: float = 1.0,
    greedy: list[bool] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    banned: dict[int, list[int]] | None = None,
) -> SamplingMetadata:
    greedy = greedy if greedy is not None else [False] * num_rows
    return SamplingMetadata(
        temperature=torch.full((num_rows,), temperature),
        top_p=torch.full((num_rows,), top_p),
        top_k=torch.full((num_rows,), top_k, dtype=torch.int64),
        greedy_mask=torch.tensor(greedy),
        all_greedy=all(greedy),
        no_top_p=top_p >= 1.0,
        no_top_k=top_k >= VOCAB,
        generators=generators or {},
        banned_token_ids=banned or {},
    )


def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The sampled token ids [N] (the sampler also returns logprobs, unused here)."""
    return Sampler()(logits, md).sampled_token_ids


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, VOCAB)
    out = _sample(logits, metadata(5, greedy=[True] * 5))
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_two_samples_only_the_two_largest() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0, 0.5, 0.2, 2.0]]).repeat(400, 1)
    out = _sample(logits, metadata(400, top_k=2))
    assert set(out.tolist()) == {1, 3}


def _kept(probs: list[float], top_p: float) -> list[bool]:
    logits = torch.tensor([probs]).log()
    masked = apply_top_k_top_p(logits, None, torch.tensor([top_p]))
    return (masked[0] > float("-inf")).tolist()


def test_top_p_keeps_the_token_that_crosses_the_threshold() -> None:
    assert _kept([0.5, 0.3, 0.2], 0.6) == [True, True, False]
    assert _kept([0.5, 0.3, 0.2], 0.5) == [True, False, False]
    assert _kept([0.2, 0.5, 0.3], 0.6) == [False, True, True]  # order in the vocab is irrelevant
    assert _kept([0.5, 0.3, 0.2], 1.0) == [True, True, True]
    assert _kept([0.5, 0.3, 0.2], 0.01) == [True, False, False]  # never empty


def test_top_k_then_top_p_per_row() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]).log()
    masked = apply_top_k_top_p(logits, torch.tensor([1, 3]), torch.tensor([1.0, 0.6]))
    assert (masked > float("-inf")).tolist() == [[True, False, False], [True, True, False]]


def test_seeded_row_is_reproducible_and_independent_of_neighbours() -> None:
    row = torch.randn(VOCAB)

    def draw(neighbours: torch.Tensor, seeded_row: int) -> int:
        logits = torch.cat([neighbours[:seeded_row], row[None], neighbours[seeded_row:]])
        md = metadata(len(logits), generators={seeded_row: seeded(1234)})
        return int(_sample(logits, md)[seeded_row])

    alone = [int(_sample(row[None], metadata(1, generators={0: seeded(1234)}))[0]) for _ in range(2)]
    assert alone[0] == alone[1]
    assert draw(torch.randn(3, VOCAB), 0) == alone[0]
    assert draw(torch.randn(5, VOCAB), 2) == alone[0]
    # A 20-token sequence from a seeded generator is a stream, and it replays too.
    first = [int(_sample(row[None], metadata(1, generators={0: g}))[0]) for g in [seeded(7)] * 20]
    again = [int(_sample(row[None], metadata(1, generators={0: g}))[0]) for g in [seeded(7)] * 20]
    assert first == again and len(set(first)) > 1


def test_banned_ids_are_never_sampled() -> None:
    logits = torch.zeros(300, VOCAB)
    logits[:, 3] = 5.0  # the favourite, and banned
    out = _sample(logits, metadata(300, banned={r: [3, 4] for r in range(300)}))
    assert not ({3, 4} & set(out.tolist()))
    greedy = _sample(logits[:1], metadata(1, greedy=[True], banned={0: [3]}))
    assert int(greedy[0]) != 3
    assert float(logits[0, 3]) == 5.0  # the caller's logits are untouched


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(6, VOCAB)
    greedy = [True, False, True, False, False, True]
    out = _sample(logits, metadata(6, temperature=5.0, greedy=greedy))
    for row in (0, 2, 5):
        assert int(out[row]) == int(logits[row].argmax())
    # Random rows at a high temperature do leave the argmax sometimes.
    many = _sample(logits[1:2].repeat(200, 1), metadata(200, temperature=5.0))
    assert len(set(many.tolist())) > 1


def test_low_temperature_concentrates_on_argmax() -> None:
    logits = torch.randn(1, VOCAB).repeat(200, 1)
    out = _sample(logits, metadata(200, temperature=1e-3))
    assert set(out.tolist()) == {int(logits[0].argmax())}
