"""Loading one checkpoint tensor into a model parameter: the whole tensor, or this rank's slice.

Chapter 6 (``load_weights``, and what changes under tensor parallelism).
vLLM 0.32 counterpart: ``vllm/model_executor/models/utils.py``
(``AutoWeightsLoader``) with ``default_weight_loader`` from
``vllm/model_executor/model_loader/weight_utils.py``.

A checkpoint always holds whole tensors; a rank's model holds slices of some
of them. vLLM attaches a ``weight_loader`` to each parameter; here the module
that owns the parameter is asked: a parallel layer (``layers/linear.py``,
``layers/vocab_parallel_embedding.py``) has a ``weight_loader`` that knows its
slice, and every other parameter (norms, convolutions, ...) is whole on every
rank and is copied as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from nanoengine.model_executor.layers.linear import ShardId, copy_weight


@runtime_checkable
class ShardedWeightOwner(Protocol):
    """A module whose parameters hold this rank's slice of the checkpoint's tensors."""

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None: ...


def load_weight(
    model: nn.Module,
    param_name: str,
    param: nn.Parameter,
    loaded_weight: torch.Tensor,
    shard_id: ShardId | None,
    checkpoint_name: str,
) -> None:
    """Copy ``loaded_weight`` (a whole checkpoint tensor) into ``param``, named
    ``param_name`` in ``model``: through its owner's ``weight_loader`` when the
    owner is a parallel layer, else whole. ValueError names the checkpoint tensor.
    """
    owner = model.get_submodule(param_name.rpartition(".")[0])
    if isinstance(owner, ShardedWeightOwner):
        try:
            owner.weight_loader(param, loaded_weight, shard_id)
        except ValueError as err:
            raise ValueError(f"Checkpoint weight '{checkpoint_name}': {err}") from err
    elif shard_id is not None:
        raise ValueError(
            f"Checkpoint weight '{checkpoint_name}' is shard {shard_id!r} of '{param_name}', "
            f"but {type(owner).__name__} has no shards."
        )
    else:
        copy_weight(param, loaded_weight, checkpoint_name)


def name_list(names: Iterable[str], limit: int = 10) -> str:
    """Sorted names for an error message, the first ``limit`` of them."""
    ordered = sorted(names)
    more = f" ... and {len(ordered) - limit} more" if len(ordered) > limit else ""
    return f"{ordered[:limit]}{more}"
