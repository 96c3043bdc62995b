"""Finding and streaming a checkpoint's safetensors files.

Chapter 6 (``load_model``). vLLM 0.32 counterpart:
``vllm/model_executor/model_loader/weight_utils.py``
(``safetensors_weights_iterator``).

Weights are yielded one tensor at a time, so peak host memory is one tensor, not
the whole checkpoint: the model copies each into place and drops it. safetensors
memory-maps the file, so "reading" a tensor is mostly a page-in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(model_path: str) -> list[Path]:
    """Every ``*.safetensors`` file directly in ``model_path``, sorted; error if none."""
    directory = Path(model_path)
    if not directory.is_dir():
        raise FileNotFoundError(f"Model directory '{model_path}' does not exist.")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors files in '{model_path}'. nanoengine loads only safetensors "
            "checkpoints (convert .bin/.pt weights with transformers' save_pretrained)."
        )
    return files


def safetensors_weights_iterator(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, CPU tensor) for every tensor of every safetensors file."""
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (the handle is not iterable)
                yield name, handle.get_tensor(name)
