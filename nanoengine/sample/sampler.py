"""The Sampler: fp32 logits in, one token id per row out.

Chapter 7 (``sample_tokens``: the last step of an engine step).
vLLM 0.32 counterpart: ``vllm/v1/sample/sampler.py`` (``Sampler``) and
``vllm/v1/sample/ops/topk_topp_sampler.py`` (``apply_top_k_top_p``,
``random_sample``).

Order of operations, per row:

1. banned token ids -> -inf (stop ids before ``min_tokens`` is reached);
2. greedy rows take the argmax of these logits; if *every* row is greedy, stop
   here — no softmax, no sort, no random numbers;
3. otherwise: divide by the temperature, keep the top-k logits, keep the top-p
   nucleus, softmax, and draw with the exponential race.

The exponential race: if ``E_i ~ Exponential(1)`` independently, then
``argmax_i p_i / E_i`` is distributed exactly as ``Categorical(p)``. It samples
a whole batch with one division and one argmax (no cumulative sums, no
``torch.multinomial`` sync), and it makes seeding simple: a seeded row draws its
own noise vector from its own generator, so its tokens do not depend on which
other requests happen to share the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoengine.sample.metadata import SamplingMetadata

_NEG_INF = float("-inf")


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: dict[int, list[int]]) -> torch.Tensor:
    """A copy of logits [N, V] with each row's banned ids at -inf (no copy if none)."""
    if not banned_token_ids:
        return logits
    logits = logits.clone()  # the caller's logits stay untouched
    for row, token_ids in banned_token_ids.items():
        logits[row, token_ids] = _NEG_INF
    return logits


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: the most likely token of each row."""
    return logits.argmax(dim=-1)


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


class Sampler(nn.Module):
    """Samples one token per logits row according to SamplingMetadata."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [N, V] fp32 -> token ids [N] int64."""
        logits = apply_banned_tokens(logits, metadata.banned_token_ids)
        greedy = greedy_sample(logits)
        if metadata.all_greedy:
            return greedy
        device = logits.device
        temperature = metadata.temperature.to(device=device, dtype=logits.dtype)
        # Greedy rows carry temperature 1.0, so this division is harmless for them.
        scaled = logits / temperature.unsqueeze(-1)
        filtered = apply_top_k_top_p(
            scaled,
            None if metadata.no_top_k else metadata.top_k.to(device),
            None if metadata.no_top_p else metadata.top_p.to(device=device, dtype=logits.dtype),
        )
        probs = filtered.softmax(dim=-1, dtype=torch.float32)
        sampled = random_sample(probs, metadata.generators, metadata.default_generator)
        return torch.where(metadata.greedy_mask.to(device), greedy, sampled)
