"""The rejection sampler: which drafted tokens the target model keeps, and one token of its own.

Chapter 9 (speculative decoding). For a request with drafts ``x_1 .. x_k`` the
target model scores ``k + 1`` positions in one forward pass: position ``j``
gives its distribution ``p_j`` for the token after ``x_1 .. x_{j-1}``, and the
last position gives the one after all ``k``. The sampler walks the drafts in
order:

* greedy: keep ``x_j`` while it is the argmax of ``p_j``; at the first
  mismatch emit the argmax instead and stop. Every emitted token is the one
  the target alone would have chosen, so the text is the same, only faster.
* with temperature: keep ``x_j`` with probability ``min(1, p_j(x_j) /
  q_j(x_j))``, where ``q_j`` is the distribution the proposer drew ``x_j``
  from; on the first rejection draw the emitted token from the *recovered*
  distribution ``max(0, p_j - q_j)`` (normalised) and stop.
* if every draft is kept, the last position adds a *bonus* token drawn from
  ``p_{k+1}``; a step then emits ``k + 1`` tokens.

Why the second rule leaves the target's distribution unchanged: the token
emitted at position ``j`` is ``y`` either because the draft was ``y`` and was
kept, with probability ``q(y) * min(1, p(y)/q(y)) = min(q(y), p(y))``, or
because a draft was rejected (total probability ``1 - sum_z min(q(z), p(z))
= sum_z max(0, p(z) - q(z))``) and ``y`` was recovered, with probability
``max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z))``. The two add up to
``min(q(y), p(y)) + max(0, p(y) - q(y)) = p(y)``.

An n-gram proposer draws nothing at random: its ``q_j`` puts all mass on
``x_j`` (``draft_probs=None`` here), so a draft is kept with probability
``p_j(x_j)`` and the recovered distribution is ``p_j`` without ``x_j``.

Plain torch, one request at a time: the rule is the lesson here, and a step
holds few requests on a CPU. ``RejectionSampler`` is the batch's entry point:
it turns the target's logits into the distributions the sampler would draw
from (the same options, penalties and temperature as ``Sampler``), verifies
each request, and gathers the logprobs of the tokens it emits.

vLLM 0.32 counterpart: ``RejectionSampler`` in ``vllm/v1/sample/rejection_sampler.py``
(``forward``, ``rejection_sample``; Triton kernels for the greedy, the
accept/reject and the recovered-token passes), after Leviathan et al. 2023
(arXiv:2211.17192).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoengine.outputs import LogprobsTensors
from nanoengine.sample.metadata import SamplingMetadata
from nanoengine.sample.sampler import Sampler, compute_logprobs, gather_logprobs


@dataclass
class RejectionSamplerOutput:
    """Per request, the tokens emitted (kept drafts, then one of the target's own)."""

    emitted_token_ids: list[list[int]]
    # Each request's first logits row: request i owns rows first_rows[i] ..
    # first_rows[i] + k_i (its k_i drafts' positions, then the last one).
    first_rows: list[int]
    # One row per scored position, as the logits came in; the emitted tokens'
    # logprobs are in each request's first len(emitted) rows. None: none asked.
    logprobs_tensors: LogprobsTensors | None


class RejectionSampler:
    """Verifies a batch's drafts against the target model's logits."""

    def __call__(
        self,
        draft_token_ids: Sequence[Sequence[int]],
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        generators: Sequence[torch.Generator | None],
    ) -> RejectionSamplerOutput:
        """draft_token_ids: request i's k_i drafts; logits: float [sum(k_i + 1), V].

        ``metadata`` has one row per logits row (each position of a request
        sees the drafts before it, for penalties and ``min_tokens``);
        ``generators``: each request's random stream.
        """
        # Logprobs describe the model, before any option (as in ``Sampler``).
        raw_logprobs = None if metadata.max_num_logprobs is None else compute_logprobs(logits)
        logits = Sampler.apply_logits_processors(logits, metadata)
        # Greedy rows are verified on the processed logits directly: the same
        # argmax the plain sampler takes, so the text cannot change.
        probs = logits if metadata.all_greedy else Sampler.compute_probs(logits, metadata)
        is_greedy = metadata.greedy_mask.tolist()
        first_rows = [0, *itertools.accumulate(len(drafts) + 1 for drafts in draft_token_ids)][:-1]
        emitted: list[list[int]] = []
        for drafts, generator, row in zip(draft_token_ids, generators, first_rows):
            rows = slice(row, row + len(drafts) + 1)
            target = logits[rows] if is_greedy[row] else probs[rows]
            emitted.extend(rejection_sample([drafts], target, [is_greedy[row]], None, generator))
        if raw_logprobs is None or metadata.max_num_logprobs is None:
            return RejectionSamplerOutput(emitted, first_rows, None)
        # Score the emitted token at each of a request's first rows; rows past
        # them are never read, so their argmax is as good a filler as any.
        chosen = raw_logprobs.argmax(dim=-1)
        for tokens, row in zip(emitted, first_rows):
            chosen[row : row + len(tokens)] = torch.tensor(tokens)
        logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, chosen)
        return RejectionSamplerOutput(emitted, first_rows, logprobs)


def rejection_sample(
    draft_token_ids: Sequence[Sequence[int]],
    target_probs: torch.Tensor,
    greedy: Sequence[bool],
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The tokens each request emits this step: its kept drafts, then one token of the target's.

    draft_token_ids: request i's ``k_i`` drafts (``k_i`` may be 0).
    target_probs: float [sum(k_i + 1), V]; request i's rows are its ``k_i``
        draft positions, then its bonus position, requests in order.
    greedy: per request, take argmaxes (``target_probs`` rows need only rank right).
    draft_probs: float [sum(k_i), V], the proposer's distributions, or None
        when every draft was certain (n-gram).
    """
    emitted: list[list[int]] = []
    row = 0
    draft_row = 0
    for drafts, is_greedy in zip(draft_token_ids, greedy):
        k = len(drafts)
        rows = target_probs[row: row + k + 1]
        proposer = None if draft_probs is None else draft_probs[draft_row: draft_row + k]
        if is_greedy:
            emitted.append(_verify_greedy(drafts, rows))
        else:
            emitted.append(_verify_random(drafts, rows, proposer, generator))
        row += k + 1
        draft_row += k
    return emitted


def _verify_greedy(drafts: Sequence[int], rows: torch.Tensor) -> list[int]:
    """rows: [k + 1, V]. Kept drafts while they are the argmax, then the argmax itself."""
    choices = rows.argmax(dim=-1).tolist()
    kept = 0
    while kept < len(drafts) and drafts[kept] == choices[kept]:
        kept += 1
    return [*drafts[:kept], choices[kept]]


def _verify_random(
    drafts: Sequence[int], rows: torch.Tensor, proposer: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """rows: [k + 1, V] target probabilities; proposer: [k, V] or None (certain drafts)."""
    out: list[int] = []
    for j, token in enumerate(drafts):
        p = rows[j]
        q_token = 1.0 if proposer is None else float(proposer[j, token])
        u = float(torch.rand((), generator=generator))
        # Keep with probability min(1, p/q): u * q < p avoids dividing by a zero q.
        if u * q_token < float(p[token]):
            out.append(token)
            continue
        out.append(_draw(_recovered(p, token, None if proposer is None else proposer[j]), generator))
        return out
    out.append(_draw(rows[len(drafts)], generator))  # every draft kept: the bonus token
    return out


def _recovered(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q), unnormalised; a certain draft's q is one-hot at ``token``.

    Rounding can leave nothing when p and q (almost) agree, although a rejection
    is then (almost) impossible: p itself is the honest fallback.
    """
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    return residual if float(residual.sum()) > 0.0 else p


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index with probability proportional to ``weights`` (float [V], not all zero)."""
    return int(torch.multinomial(weights, 1, generator=generator))
