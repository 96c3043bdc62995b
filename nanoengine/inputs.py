"""The prompt types ``generate`` accepts: a string, ``TextPrompt`` or ``TokensPrompt``.

Chapter 1 (quickstart) passes them to ``LLM.generate``; the renderer
(renderers/hf.py, chapter 5) turns each into token ids. They live here so that
a vLLM script's ``from vllm.inputs import TokensPrompt`` becomes
``from nanoengine.inputs import TokensPrompt``.
vLLM 0.32 counterpart: ``vllm/inputs/llm.py`` (``TextPrompt``, ``TokensPrompt``,
``PromptType``), exported by ``vllm/inputs/__init__.py``.
"""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict, total=False):
    prompt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str  # optional: the text the ids came from, echoed in RequestOutput


# What generate() accepts for one prompt, as in vLLM.
PromptType = str | TextPrompt | TokensPrompt
