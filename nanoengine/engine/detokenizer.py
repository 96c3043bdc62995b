"""Incremental detokenization and stop strings.

Chapter 7 (``generate(...)``): each step adds one token per request, so the text
is grown token by token rather than re-decoded from scratch. Stop strings are a
text-level condition, so they are checked here, on the front-end side, and the
engine core is then told to abort the request.
vLLM 0.32 counterpart: ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``,
``check_stop_strings``).
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from nanoengine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Appends text as tokens arrive; finds the first stop string in the output."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.params = params
        self.stop_strings: list[str] = list(params.stop or [])
        self.output_text = ""
        # The Rust tokenizer behind transformers' fast tokenizer; DecodeStream
        # keeps the few-token window needed to emit whole UTF-8 characters.
        self._backend = tokenizer._tokenizer if params.detokenize else None
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string that ended the text, if one did.

        On a match the text is cut at the stop string (kept or dropped according
        to ``include_stop_str_in_output``).
        """
        if self._backend is None:
            return None
        for token_id in new_token_ids:
            before = len(self.output_text)
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self.output_text += piece
            stop = self._find_stop_string(before)
            if stop is not None:
                return stop
        return None

    def _find_stop_string(self, new_text_start: int) -> str | None:
        """Search only where a match could newly appear: a stop string may start
        up to ``len(stop) - 1`` characters before the new text.
        """
        for stop in self.stop_strings:
            search_from = max(new_text_start - len(stop) + 1, 0)
            index = self.output_text.find(stop, search_from)
            if index != -1:
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                self.output_text = self.output_text[:end]
                return stop
        return None
