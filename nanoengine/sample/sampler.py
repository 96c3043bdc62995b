"""The Sampler: fp32 logits in, one token id per row out (and logprobs if asked).

Chapter 7 (``sample_tokens``: the last step of an engine step); chapter 8 adds
the OpenAI API's options (logit_bias, penalties, min_p, logprobs).
vLLM 0.32 counterpart: ``vllm/v1/sample/sampler.py`` (``Sampler``),
``vllm/v1/sample/ops/topk_topp_sampler.py`` (``apply_top_k_top_p``,
``random_sample``) and the built-in logits processors of
``vllm/v1/sample/logits_processor/builtin.py`` (min_tokens, logit_bias, min_p);
``compute_logprobs`` and ``gather_logprobs`` are ``Sampler.compute_logprobs``
and ``Sampler.gather_logprobs`` there, and they score prompt tokens too
(``prompt_logprobs``, worker/prompt_logprobs.py).

Order of operations, per row, as in vLLM:

0. if any row asks for logprobs: log_softmax of the logits as they came in
   (``compute_logprobs``), kept aside: they describe the model, not the
   sampling options (vLLM's default ``logprobs_mode="raw_logprobs"``);
1. banned token ids -> -inf (stop ids before ``min_tokens`` is reached), then
   logit_bias added;
2. repetition, frequency and presence penalties (sample/penalties.py);
3. greedy rows take the argmax of these logits; if *every* row is greedy, stop
   here — no softmax, no sort, no random numbers;
4. otherwise: divide by the temperature, drop tokens below min_p times the most
   likely one's probability, keep the top-k logits, keep the top-p nucleus,
   softmax, and draw with the exponential race;
5. the sampled tokens' logprobs, ranks and the top candidates from step 0
   (``gather_logprobs``).

Steps 0, 1 and 2 cost nothing for rows (and batches) that do not use them.

The exponential race: if ``E_i ~ Exponential(1)`` independently, then
``argmax_i p_i / E_i`` is distributed exactly as ``Categorical(p)``. It samples
a whole batch with one division and one argmax (no cumulative sums, no
``torch.multinomial`` sync), and it makes seeding simple: a seeded row draws its
own noise vector from its own generator, so its tokens do not depend on which
other requests happen to share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoengine.outputs import LogprobsTensors
from nanoengine.sample.metadata import SamplingMetadata
from nanoengine.sample.penalties import apply_penalties

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs_tensors: LogprobsTensors | None  # None when no row asked for logprobs


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: dict[int, list[int]]) -> torch.Tensor:
    """A copy of logits [N, V] with each row's banned ids at -inf (no copy if none)."""
    if not banned_token_ids:
        return logits
    logits = logits.clone()  # the caller's logits stay untouched
    for row, token_ids in banned_token_ids.items():
        logits[row, token_ids] = _NEG_INF
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> torch.Tensor:
    """A copy of logits [N, V] with each row's biases added, in one scatter."""
    if not logit_bias:
        return logits
    rows = [row for row, biases in logit_bias.items() for _ in biases]
    token_ids = [token_id for biases in logit_bias.values() for token_id in biases]
    values = [bias for biases in logit_bias.values() for bias in biases.values()]
    device = logits.device
    return logits.index_put(
        (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device)),
        torch.tensor(values, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def apply_logit_bias_reference(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> torch.Tensor:
    """``apply_logit_bias`` one entry at a time."""
    result = logits.clone()
    for row, biases in logit_bias.items():
        for token_id, bias in biases.items():
            result[row, token_id] += bias
    return result


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: the most likely token of each row."""
    return logits.argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens of logits [N, V] less likely than ``min_p`` [N] times the row's top one.

    The most likely token always stays; ``min_p = 0`` keeps the whole row. Applied
    after the temperature, so "likely" means under the distribution being sampled.
    """
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)  # [N, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_min_p_reference(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``apply_min_p`` one row and one token at a time."""
    result = logits.clone()
    for row in range(logits.shape[0]):
        probs = logits[row].softmax(dim=-1).tolist()
        threshold = max(probs) * float(min_p[row])
        for token_id, prob in enumerate(probs):
            if prob < threshold:
                result[row, token_id] = _NEG_INF
    return result


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k = top_k[row]); -inf elsewhere.

    Without top-p no full sort is needed: ``torch.topk`` up to the largest k gives
    every row's k-th value, the threshold. Ties with it are kept.
    """
    vocab_size = logits.shape[-1]
    k = top_k.clamp(1, vocab_size)  # [N]
    max_k = int(k.max())
    top_values = logits.topk(max_k, dim=-1).values  # [N, max_k], descending
    threshold = top_values.gather(-1, (k - 1).unsqueeze(-1))  # [N, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits [N, V] outside each row's top-k set and top-p nucleus.

    ``top_k`` [N] int64 (vocab size = off), ``top_p`` [N] float (1.0 = off); None
    skips the filter for the whole batch. Top-p keeps the smallest set of most
    likely tokens whose probability reaches ``top_p``: the token that crosses the
    threshold is kept, and the most likely token always is.
    """
    if top_p is None:
        return logits if top_k is None else apply_top_k_only(logits, top_k)
    # [N, V] each row sorted most likely first; order[r, j] = vocab id of rank j
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = top_k.clamp(1, logits.shape[-1])
        threshold = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Probability mass strictly *before* rank j. Shifting the running sum (rather
    # than subtracting probs from it) keeps rank 0's entry an exact 0 and rank 1's
    # an exact p_0, so boundary cases such as p_0 == top_p behave as written.
    mass_before = probs.cumsum(dim=-1).roll(1, dims=-1)
    mass_before[:, 0] = 0.0
    # Rank j is dropped once the tokens ahead of it already reach top_p.
    drop = mass_before >= top_p.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    # Undo the sort: rank j's value goes back to vocab position order[:, j].
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def random_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Draw one token per row of probs [N, V] with the exponential race.

    Rows listed in ``generators`` take noise from their own generator; the rest
    share ``default_generator`` (None: torch's global one).
    """
    noise = torch.empty_like(probs)  # [N, V] Exponential(1) draws
    if len(generators) < probs.shape[0]:
        noise.exponential_(generator=default_generator)
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # An exact 0 draw would turn a 0-probability (masked) token into 0/0 = NaN,
    # and argmax treats NaN as the maximum. The smallest normal float avoids that.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div(noise).argmax(dim=-1)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 log probabilities."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The chosen ``token_ids`` [N] and the ``num_logprobs`` most likely tokens of each row.

    A chosen token's rank counts the tokens at least as likely as it, itself
    included, so the argmax has rank 1 (ties share the worse rank, as in vLLM).
    """
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, k] each, most likely first
    chosen_ids = token_ids.to(torch.int64).unsqueeze(-1)  # [N, 1]
    chosen_logprobs = logprobs.gather(-1, chosen_ids)  # [N, 1]
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)  # [N]
    return LogprobsTensors(
        logprob_token_ids=torch.cat([chosen_ids, top_ids], dim=-1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=-1),
        selected_token_ranks=ranks,
    )


def gather_logprobs_reference(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """``gather_logprobs`` one row at a time with a full sort: the plain reference the
    tests hold the batched version to.
    """
    rows_ids: list[torch.Tensor] = []
    rows_logprobs: list[torch.Tensor] = []
    ranks: list[int] = []
    for row, token_id in zip(logprobs, token_ids.tolist()):
        order = row.argsort(descending=True)  # [V] token ids, most likely first
        top_ids = order[:num_logprobs]
        rows_ids.append(torch.cat([torch.tensor([token_id]), top_ids]))
        rows_logprobs.append(torch.cat([row[token_id : token_id + 1], row[top_ids]]))
        ranks.append(sum(1 for value in row.tolist() if value >= float(row[token_id])))
    return LogprobsTensors(torch.stack(rows_ids), torch.stack(rows_logprobs), torch.tensor(ranks))


class Sampler(nn.Module):
    """Samples one token per logits row according to SamplingMetadata."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] fp32 -> token ids [N] int64, plus logprobs for rows that ask."""
        num_logprobs = metadata.max_num_logprobs
        # Before any processing: logprobs describe the model (vLLM's "raw_logprobs").
        raw_logprobs = None if num_logprobs is None else compute_logprobs(logits)
        logits = self.apply_logits_processors(logits, metadata)
        sampled = self.sample(logits, metadata)
        if raw_logprobs is None or num_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, num_logprobs, sampled))

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The steps that may change which token is the argmax: bans, bias, penalties."""
        logits = apply_banned_tokens(logits, metadata.banned_token_ids)
        logits = apply_logit_bias(logits, metadata.logit_bias)
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        return logits

    @classmethod
    def sample(cls, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; the others draw from their filtered distribution."""
        greedy = greedy_sample(logits)
        if metadata.all_greedy:
            return greedy
        probs = cls.compute_probs(logits, metadata)
        sampled = random_sample(probs, metadata.generators, metadata.default_generator)
        return torch.where(metadata.greedy_mask.to(logits.device), greedy, sampled)

    @staticmethod
    def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution each row draws from, [N, V] float32: temperature, min_p,
        top-k, top-p, softmax. The rejection sampler (chapter 9) verifies drafts
        against the same distribution.
        """
        device = logits.device
        temperature = metadata.temperature.to(device=device, dtype=logits.dtype)
        # Greedy rows carry temperature 1.0, so this division is harmless for them.
        scaled = logits / temperature.unsqueeze(-1)
        if metadata.min_p is not None:
            scaled = apply_min_p(scaled, metadata.min_p.to(device=device, dtype=logits.dtype))
        filtered = apply_top_k_top_p(
            scaled,
            None if metadata.no_top_k else metadata.top_k.to(device),
            None if metadata.no_top_p else metadata.top_p.to(device=device, dtype=logits.dtype),
        )
        return filtered.softmax(dim=-1, dtype=torch.float32)
