"""LogprobsProcessor: the front end's half of logprobs -- lists of numbers to ``Logprob`` dicts.

Chapter 8. The engine core sends each request's logprobs as ``LogprobsLists``
(token ids and numbers, nanoengine/logprobs.py); here every position becomes a
``{token id: Logprob(logprob, rank, decoded_token)}`` dict holding the chosen
token and the top candidates, ``cumulative_logprob`` adds up the sampled tokens'
logprobs, and the prompt's dicts get their leading None.
vLLM 0.32 counterpart: ``vllm/v1/engine/logprobs.py`` (``LogprobsProcessor``).
"""

from __future__ import annotations

import itertools
from typing import Any

from nanoengine.logprobs import Logprob, LogprobsLists, PromptLogprobs, SampleLogprobs
from nanoengine.sampling_params import SamplingParams


class LogprobsProcessor:
    """One request's logprobs so far; empty and free when it asked for none."""

    def __init__(self, tokenizer: Any | None, params: SamplingParams) -> None:
        # Decoding each candidate token is the expensive part; detokenize=False skips
        # it, and without a tokenizer (skip_tokenizer_init) every decoded_token is None.
        self.tokenizer = tokenizer if params.detokenize else None
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.prompt_logprobs: PromptLogprobs | None = None
        self._sampled_logprob_sum = 0.0

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs; None unless logprobs were asked for."""
        return None if self.logprobs is None else self._sampled_logprob_sum

    def update_from_output(
        self, new_logprobs: LogprobsLists | None, new_prompt_logprobs: LogprobsLists | None
    ) -> None:
        if new_logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(self._position_dicts(new_logprobs))
            # The chosen (sampled) token is the first entry of every row.
            self._sampled_logprob_sum += sum(row[0] for row in new_logprobs.logprobs)
        if new_prompt_logprobs is not None:
            self.prompt_logprobs = [None, *self._position_dicts(new_prompt_logprobs)]

    def _position_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        """One dict per row: the chosen token with its rank, then top-1 .. top-k.

        A chosen token that is also among the top k appears once: the dict keeps
        the later, top-k entry, whose rank is its place in the top k.
        """
        dicts: list[dict[int, Logprob]] = []
        for token_ids, logprobs, rank in zip(
            lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks
        ):
            ranks = itertools.chain([rank], range(1, len(token_ids)))
            texts = self._decode_each(token_ids)
            dicts.append(
                {
                    token_id: Logprob(lp, r, text)
                    for token_id, lp, r, text in zip(token_ids, logprobs, ranks, texts)
                }
            )
        return dicts

    def _decode_each(self, token_ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(token_ids)
        return list(self.tokenizer.batch_decode([[token_id] for token_id in token_ids]))
