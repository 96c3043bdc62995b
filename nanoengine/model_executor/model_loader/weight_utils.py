"""Finding and streaming a checkpoint's safetensors files, or making up dummy weights.

Chapter 6 (``load_model``). vLLM 0.32 counterpart:
``vllm/model_executor/model_loader/weight_utils.py``
(``safetensors_weights_iterator``, ``initialize_dummy_weights``).

Weights are yielded one tensor at a time, so peak host memory is one tensor, not
the whole checkpoint: the model copies each into place and drops it. safetensors
memory-maps the file, so "reading" a tensor is mostly a page-in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


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


# vLLM's range for dummy weights: values this small keep activations far from
# overflow, so in practice a forward pass of random weights has no NaN or inf.
DUMMY_WEIGHT_LOW = -1e-3
DUMMY_WEIGHT_HIGH = 1e-3


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of ``model`` in place, uniform in [-1e-3, 1e-3], from ``seed``.

    The same seed gives the same weights on the same device. Norm weights get
    the same small values as every other parameter, as in vLLM: no parameter
    is special-cased. A Llama ``RMSNorm`` then scales by about 1e-3, a
    zero-centred Qwen3.5 norm (which multiplies by 1 + w) by about 1.

    Two choices differ from vLLM's. vLLM reseeds a fresh generator for every
    tensor with a fixed seed (1234); here one generator, seeded by
    ``ModelConfig.seed``, walks the parameters in order, so two parameters of
    one shape do not come out as copies of each other. Under tensor
    parallelism every rank walks parameters of the same shapes in the same
    order, so the parameters every rank holds whole (the norms) agree across
    ranks; a sharded weight is drawn for the slice, so dummy weights at N ranks
    are not those at one rank (vLLM's are not either) -- only a checkpoint
    gives the same model at every N. vLLM walks ``state_dict()``, parameters and persistent buffers;
    nanoengine's models keep no persistent buffer (RoPE's ``inv_freq`` is
    recomputed from the config), and ``parameters()`` lists a tied embedding
    once instead of twice.
    """
    parameters = list(model.parameters())
    generator = torch.Generator(device=parameters[0].device)
    generator.manual_seed(seed)
    for parameter in parameters:
        parameter.uniform_(DUMMY_WEIGHT_LOW, DUMMY_WEIGHT_HIGH, generator=generator)
