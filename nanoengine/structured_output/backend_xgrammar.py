"""The xgrammar backend: compile choice / regex / JSON-schema grammars, fill bitmasks.

Chapter 5 (engine skeleton). xgrammar compiles a grammar against the
tokenizer's vocabulary once; a per-request ``GrammarMatcher`` then tracks where
the output is in the grammar and writes the allowed next tokens as a packed
bitmask: int32 words, bit ``j`` of word ``w`` allowing token ``32 * w + j``.
Imported lazily (by the manager's compile thread), so engines that never see a
grammar never load xgrammar.
vLLM 0.32 counterpart: ``vllm/v1/structured_output/backend_xgrammar.py``
(``XgrammarBackend``, ``XgrammarGrammar``).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr

from nanoengine.exceptions import ValidationError
from nanoengine.sampling_params import StructuredOutputsParams
from nanoengine.structured_output.request import StructuredOutputGrammar


class XgrammarGrammar(StructuredOutputGrammar):
    """One request's matcher over a compiled grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return all(self.matcher.accept_token(token_id) for token_id in token_ids)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend:
    """A grammar compiler bound to one tokenizer and the model's vocabulary size."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        # vocab_size is the model's (the logits' width), which may exceed the
        # tokenizer's: padded rows are never allowed.
        self.vocab_size = vocab_size
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # One compile thread of xgrammar's own: the manager's pool already runs
        # compiles off the engine thread, and the machine may have two cores.
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1)

    def compile_grammar(self, params: StructuredOutputsParams) -> XgrammarGrammar:
        """Compile; a bad regex or schema raises (the request then ends as FINISHED_ERROR)."""
        if params.choice is not None:
            compiled = self.compiler.compile_grammar(_choice_grammar(params.choice))
        elif params.regex is not None:
            compiled = self.compiler.compile_regex(params.regex)
        else:
            compiled = self.compiler.compile_json_schema(params.json_schema_text())
        return XgrammarGrammar(compiled)

    def allocate_token_bitmask(self, num_rows: int) -> torch.Tensor:
        """int32 [num_rows, ceil(vocab_size / 32)], every token allowed."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def _choice_grammar(choices: list[str]) -> str:
    """A choice is a grammar of alternatives; json.dumps quotes and escapes each
    string the way EBNF literals expect."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def validate_xgrammar_grammar(params: StructuredOutputsParams) -> None:
    """Parse the grammar without a vocabulary, raising ``ValidationError`` if it is not one.

    A server checks this before it answers 200 (as vLLM's front end does), so a
    broken regex is a 400 rather than a stream that ends with nothing. Offline,
    the request goes in and ends as FINISHED_ERROR, which chapter 5 shows.
    """
    try:
        if params.choice is not None:
            xgr.Grammar.from_ebnf(_choice_grammar(params.choice))
        elif params.regex is not None:
            xgr.Grammar.from_regex(params.regex)
        else:
            xgr.Grammar.from_json_schema(params.json_schema_text())
    except RuntimeError as error:
        raise ValidationError(f"The grammar is not valid: {error}".strip(), parameter="structured_outputs") from None
