"""Comparing two greedy runs that need not agree token for token (bf16).

In fp32 nanoengine and HF transformers pick the same greedy tokens (the parity
tests assert it). In bf16 every matmul rounds its output to 8 significant bits,
and two implementations that sum in different orders round differently: where
the model hesitates between two tokens, one run may pick the other's second
choice, and from there on the two continuations are different texts, neither
of them wrong.

``check_logprobs_close`` is the test vLLM uses for exactly this
(``tests/models/utils.py`` in vLLM), written here from its description: walk
both greedy sequences of a prompt; at the first position where they differ,
each side's token must be among the other side's top-k logprobs there (a near
tie, not a broken model), and the comparison of that prompt stops, since the
two sides no longer condition on the same text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypedDict

import torch

from nanoengine.outputs import RequestOutput

# bf16 stores 8 significant bits: one rounding moves a value by at most half a
# unit in the last place, 2**-8 of it. torch.testing's own bf16 default rtol,
# 1.6e-2, allows about four such roundings; the checks below name which they use.
BF16_RTOL = 1.6e-2
BF16_ONE_ULP = 2.0**-7  # relative distance between neighbouring bf16 values, at most


class Tolerance(TypedDict):
    """Keyword arguments of torch.testing.assert_close: ``assert_close(a, b, **tol)``."""

    atol: float
    rtol: float


class GreedyRun(NamedTuple):
    """One prompt's greedy continuation and, per position, {token id: logprob} of the top k
    (a side may add its own chosen token, as nanoengine's logprobs do)."""

    token_ids: list[int]
    logprobs: list[Mapping[int, float]]


def check_logprobs_close(
    runs_0: Sequence[GreedyRun], runs_1: Sequence[GreedyRun], name_0: str, name_1: str
) -> None:
    """Two greedy runs over the same prompts agree up to near ties (see the module docstring).

    Raises AssertionError naming the prompt, the position and both tokens when,
    at the first divergence of a prompt, either token is missing from the other
    side's top-k. Runs that never diverge must also have the same length.
    """
    assert len(runs_0) == len(runs_1), f"{name_0} has {len(runs_0)} prompts, {name_1} {len(runs_1)}"
    for prompt, (run_0, run_1) in enumerate(zip(runs_0, runs_1)):
        for name, run in ((name_0, run_0), (name_1, run_1)):
            assert len(run.logprobs) == len(run.token_ids), (
                f"prompt {prompt}: {name} has {len(run.token_ids)} tokens but logprobs for "
                f"{len(run.logprobs)} positions"
            )
        diverged = False
        for position, (token_0, token_1) in enumerate(zip(run_0.token_ids, run_1.token_ids)):
            if token_0 == token_1:
                continue
            top_0, top_1 = run_0.logprobs[position], run_1.logprobs[position]
            assert token_0 in top_1 and token_1 in top_0, (
                f"prompt {prompt}, position {position}: {name_0} chose {token_0}, {name_1} chose "
                f"{token_1}, and this is no near tie: {name_0}'s top-k {dict(top_0)}, "
                f"{name_1}'s top-k {dict(top_1)}\n{name_0}: {run_0.token_ids}\n{name_1}: {run_1.token_ids}"
            )
            diverged = True
            break  # the two continuations now condition on different text
        if not diverged:
            assert len(run_0.token_ids) == len(run_1.token_ids), (
                f"prompt {prompt}: {name_0} has {len(run_0.token_ids)} tokens, {name_1} "
                f"{len(run_1.token_ids)}, with no divergence between them"
            )


def top_k_logprobs(logits: torch.Tensor, k: int) -> dict[int, float]:
    """{token id: logprob} of the k most likely tokens of one row of logits, in fp32
    (the log_softmax of bf16 logits is taken after widening them, as the engine does)."""
    logprobs = logits.float().log_softmax(dim=-1)
    top = logprobs.topk(k)
    return dict(zip(top.indices.tolist(), top.values.tolist()))


def engine_greedy_runs(outputs: Sequence[RequestOutput]) -> list[GreedyRun]:
    """The first completion of each nanoengine output (generated with ``logprobs=k``)
    as a GreedyRun: {token id: logprob} per position, the sampled token included."""
    runs = []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None, "generate with SamplingParams(logprobs=k)"
        positions: list[Mapping[int, float]] = [
            {t: lp.logprob for t, lp in position.items()} for position in completion.logprobs
        ]
        runs.append(GreedyRun(list(completion.token_ids), positions))
    return runs
