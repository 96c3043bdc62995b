"""The two collectives the sharded layers call, over this process's tensor-parallel group.

Chapter 6 (tensor parallelism: where ranks exchange data during a forward pass).
vLLM 0.32 counterpart: ``vllm/distributed/communication_op.py``
(``tensor_model_parallel_all_reduce``, ``tensor_model_parallel_all_gather``).

A layer calls these without holding the group: the group belongs to the
process (``parallel_state``). Both are the identity when the process is
alone, so a caller may call them unconditionally; the layers still skip the
call at world size 1, which keeps a single-process step exactly as it was.
"""

from __future__ import annotations

import torch

from nanoengine.distributed.parallel_state import get_tensor_model_parallel_world_size, get_tp_group


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over the TP ranks (in place; any shape)."""
    if get_tensor_model_parallel_world_size() == 1:
        return tensor
    return get_tp_group().all_reduce(tensor)


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every TP rank's ``tensor`` concatenated along ``dim`` in rank order."""
    if get_tensor_model_parallel_world_size() == 1:
        return tensor
    return get_tp_group().all_gather(tensor, dim)
