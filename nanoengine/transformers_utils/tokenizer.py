"""Which token ids end a generation, read from the tokenizer and generation_config.json.

Chapter 7: the scheduler stops a request on any of these (unless ``ignore_eos``).
vLLM 0.32 counterpart: ``vllm/transformers_utils/config.py`` (``try_get_generation_config``)
and ``SamplingParams.update_from_generation_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def get_generation_eos_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The tokenizer's EOS plus every ``eos_token_id`` in generation_config.json.

    Chat models often end a turn with a token (``<|im_end|>``) that differs from
    the tokenizer's EOS; generation_config.json is where the model says so.
    """
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(x) for x in eos)
    return sorted(ids)
