"""HfRenderer: prompts and chat conversations to token ids with a HF tokenizer.

Chapter 5 (engine skeleton) lists it as ``LLMEngine.renderer``; chapter 1 uses it
through ``LLM.chat``. vLLM 0.32 counterpart: ``vllm/renderers/hf.py``
(``HfRenderer``), created in ``vllm/v1/engine/llm_engine.py``.

Built without a tokenizer (``skip_tokenizer_init=True``, chapter 6) it passes
token-id prompts through and refuses text and chat with a ValueError that
names the setting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

# Re-exported: code written before nanoengine/inputs.py imports them from here.
from nanoengine.inputs import PromptType, TextPrompt, TokensPrompt

__all__ = ["ChatMessage", "HfRenderer", "PromptType", "RenderedPrompt", "TextPrompt", "TokensPrompt"]

ChatMessage = Mapping[str, Any]
# The roles of OpenAI's chat API that a chat template can be expected to know.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class RenderedPrompt(TypedDict):
    prompt: str | None
    prompt_token_ids: list[int]


class HfRenderer:
    """Tokenizes text prompts and applies the model's chat template."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer  # None: skip_tokenizer_init=True, token ids only

    def render_prompt(self, prompt: PromptType) -> RenderedPrompt:
        """One prompt in any accepted form -> text (if known) and token ids."""
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": self._encode(prompt)}
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]  # type: ignore[typeddict-item]
                if not isinstance(ids, Sequence) or isinstance(ids, str):
                    raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}.")
                return {"prompt": prompt.get("prompt"), "prompt_token_ids": list(ids)}
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                text = prompt["prompt"]
                return {"prompt": text, "prompt_token_ids": self._encode(text)}
        raise TypeError(
            "A prompt must be a str, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}: {prompt!r:.80}."
        )

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """Apply the chat template; the result is a text prompt plus its ids."""
        validate_chat_messages(messages)
        tokenizer = self._tokenizer_for("A chat conversation")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("This model's tokenizer has no chat template; use generate() with plain text.")
        text = tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **dict(chat_template_kwargs or {}),
        )
        # The template already wrote any BOS token, so no special tokens are added.
        ids = tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": list(ids)}

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer_for("A text prompt").encode(text))

    def _tokenizer_for(self, what: str) -> Any:
        """The tokenizer, or a ValueError saying that ``what`` needs one."""
        if self.tokenizer is None:
            raise ValueError(
                f"{what} needs a tokenizer, and this engine was built with skip_tokenizer_init=True. "
                "Pass token ids instead: {'prompt_token_ids': [...]}."
            )
        return self.tokenizer


def validate_chat_messages(messages: Sequence[ChatMessage]) -> None:
    """Reject a conversation the chat template would render wrongly or fail on.

    A template reads ``message['role']`` and ``message['content']`` with no
    checks of its own: a missing role renders as an empty string and a list
    where text belongs renders as its Python repr, so the model would silently
    see a garbled prompt. Every problem is a ValueError, even a wrong type: it
    is a malformed request, which a server answers with 400 (chapter 8).
    """
    if not messages:
        raise ValueError("A chat conversation needs at least one message, got [].")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(  # noqa: TRY004 (a malformed request, see above)
                f"Chat message {index} must be a dict with 'role' and 'content', got {message!r:.80}."
            )
        if "role" not in message:
            raise ValueError(f"Chat message {index} has no 'role' (one of {', '.join(CHAT_ROLES)}).")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(
                f"Chat message {index} has an unknown role {message['role']!r}; "
                f"known roles: {', '.join(CHAT_ROLES)}."
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(  # noqa: TRY004 (a malformed request, see above)
                f"Chat message {index} content must be a str, got {type(content).__name__}."
            )
