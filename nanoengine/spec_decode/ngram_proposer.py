"""NgramProposer: drafts taken from the request's own earlier tokens (prompt lookup).

Chapter 9. When an answer copies from its prompt -- a summary quoting the
text, a code edit repeating the file -- the tokens after the answer's last few
tokens are likely to be what followed the same few tokens earlier. So: take
the longest suffix of ``n`` tokens (``prompt_lookup_min <= n <=
prompt_lookup_max``) that also occurs earlier in the request, take its
earliest occurrence, and propose the (up to ``k``) tokens that followed it.
No model runs; a step costs a search over the request's tokens.

    tokens:  the cat sat on the mat . the cat sat on
    suffix "the cat sat on" (n = 4) occurs at position 0 -> draft "the mat ."

``find_ngram_draft`` does the search with numpy (every window compared at
once); ``find_ngram_draft_reference`` is the same rule as plain loops, which
the tests hold the fast one to.

vLLM 0.32 counterpart: ``vllm/v1/spec_decode/ngram_proposer.py``
(``NgramProposer``, ``_find_longest_matched_ngram_and_propose_tokens``, which
runs a KMP-style scan under numba; the result is the same match).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nanoengine.config import SpeculativeConfig


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` draft tokens per request."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """One draft per request (prompt and output so far); empty where nothing matches.

        A draft never runs past ``max_model_len``: each drafted token takes a
        position of the context, and the target must be able to score it.
        """
        drafts = []
        for tokens in token_ids:
            room = min(self.k, self.max_model_len - len(tokens))
            draft = find_ngram_draft(np.asarray(tokens, dtype=np.int64), self.min_n, self.max_n, room)
            drafts.append(draft.tolist())
        return drafts


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The tokens that followed the earliest earlier occurrence of the longest matching suffix.

    tokens: int [T]. Tries n = max_n down to min_n; the first n whose suffix
    ``tokens[T-n:]`` also starts at some p <= T-n-1 wins, with the smallest
    such p; the draft is ``tokens[p+n : p+n+k]`` (shorter if the tokens end).
    """
    total = len(tokens)
    if k <= 0:
        return tokens[:0]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Every window of n tokens that ends before the last token, [T-n, n].
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start: start + k]
    return tokens[:0]


def find_ngram_draft_reference(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The same rule as ``find_ngram_draft``, one comparison at a time."""
    total = len(tokens)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= total:
            continue
        suffix = list(tokens[total - n:])
        for start in range(total - n):  # a match must end before the last token
            if list(tokens[start: start + n]) == suffix:
                return list(tokens[start + n: start + n + k])
    return []
