"""Which token ids end a generation, read from the tokenizer and the generation config.

Chapter 7: the scheduler stops a request on any of these (unless ``ignore_eos``).
Chapter 6: with ``skip_tokenizer_init=True`` there is no tokenizer, and the
generation config alone names them.
vLLM 0.32 counterpart: ``vllm/transformers_utils/config.py`` (``try_get_generation_config``)
and ``SamplingParams.update_from_generation_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def get_generation_eos_ids(model_path: str, tokenizer: Any, hf_config: Any) -> list[int]:
    """The tokenizer's EOS (if there is a tokenizer) plus the generation config's.

    Chat models often end a turn with a token (``<|im_end|>``) that differs from
    the tokenizer's EOS; generation_config.json is where the model says so. A
    folder without that file falls back to the model config's ``eos_token_id``,
    as vLLM does (it builds the generation config from the model config).
    """
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids.update(_as_id_list(_generation_eos(model_path, hf_config)))
    return sorted(ids)


def _generation_eos(model_path: str, hf_config: Any) -> Any:
    """``eos_token_id`` of generation_config.json, else of the (text) model config."""
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        return json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id")
    # A vision-language config keeps the text model's ids under text_config.
    return getattr(hf_config.get_text_config(), "eos_token_id", None)


def _as_id_list(eos: Any) -> list[int]:
    """An ``eos_token_id`` field (one int, a list of them, or missing) as a list."""
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [int(x) for x in eos]
    return []
