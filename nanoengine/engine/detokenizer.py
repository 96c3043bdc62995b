"""Incremental detokenization and stop strings.

Chapter 7 (``generate(...)``): each step adds one token per request, so the text
is grown token by token rather than re-decoded from scratch. Stop strings are a
text-level condition, so they are checked here, on the front-end side, and the
engine core is then told to abort the request.
vLLM 0.32 counterpart: ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``,
``check_stop_strings``).

Without a tokenizer (``skip_tokenizer_init=True``, chapter 6) or with
``detokenize=False`` it stays idle: the text stays empty, the token ids
still flow.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from nanoengine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Appends text as tokens arrive; finds the first stop string in the output."""

    def __init__(self, tokenizer: Any | None, params: SamplingParams) -> None:
        self.params = params
        self.stop_strings: list[str] = list(params.stop or [])
        self.output_text = ""
        # The Rust tokenizer behind transformers' fast tokenizer; DecodeStream
        # keeps the few-token window needed to emit whole UTF-8 characters.
        self._backend = tokenizer._tokenizer if tokenizer is not None and params.detokenize else None
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        # While the request runs, its outputs hold back the last characters that
        # could still be the start of a stop string (chapter 8): once matched it
        # is cut from the text, and a streamed piece cannot be taken back.
        cut_at_stop = self.stop_strings and not params.include_stop_str_in_output
        self.stop_buffer_length = max(map(len, self.stop_strings)) - 1 if cut_at_stop else 0
        self._num_chars_sent = 0  # how much text DELTA outputs have carried so far

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add tokens; return the stop string that ended the text, if one did.

        On a match the text is cut at the stop string (kept or dropped according
        to ``include_stop_str_in_output``). ``stop_terminated``: the engine core
        stopped on the last token (EOS or a ``stop_token_ids`` entry); like a stop
        string, its text joins the output only with ``include_stop_str_in_output``.
        """
        if self._backend is None:
            return None
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            before = len(self.output_text)
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self.output_text += piece
            stop = self._find_stop_string(before)
            if stop is not None:
                return stop
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text of the next RequestOutput: everything so far, or with ``delta``
        only what the previous call did not return.
        """
        end = len(self.output_text) if finished else max(len(self.output_text) - self.stop_buffer_length, 0)
        if not delta:
            return self.output_text[:end]
        start = self._num_chars_sent
        self._num_chars_sent = max(end, start)
        return self.output_text[start:end]

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
