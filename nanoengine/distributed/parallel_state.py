"""Who is who in a tensor-parallel run: the process group, this process's rank, its collectives.

Chapter 6 (tensor parallelism: the worker processes and the group they form).
vLLM 0.32 counterpart: ``vllm/distributed/parallel_state.py``
(``GroupCoordinator``, ``init_distributed_environment``,
``initialize_model_parallel``, ``get_tp_group``,
``get_tensor_model_parallel_world_size``/``_rank``,
``destroy_model_parallel``, ``destroy_distributed_environment``).

Tensor parallelism splits every big weight matrix across N processes. Each
runs the same model code on its slice, and a few times per layer they combine
partial results: sum them (all-reduce) or concatenate them (all-gather).
Those exchanges go through ``torch.distributed``, which first needs every
process to join one *process group*: ``init_distributed_environment`` does
that (gloo on a CPU, NCCL on CUDA GPUs), ``initialize_model_parallel`` then
carves the tensor-parallel group out of it (the whole world, as nanoengine
has no pipeline or data parallelism).

Layers ask, when built, how many ranks share a weight and which slice is
theirs. With nothing initialized the answers are 1 and 0: a single-process
engine never creates a group nor calls ``torch.distributed``. vLLM's
``GroupCoordinator`` also owns device communicators (custom all-reduce
kernels, shared-memory queues, a CPU group for metadata); this one keeps the
two collectives the model needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a collective waits for a peer before giving up. gloo's default is
# 30 minutes; a dead peer should surface sooner. The executor (which watches
# its worker processes) normally notices first.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass
class GroupCoordinator:
    """One process group as seen from one of its members.

    ``ranks`` are global ranks (positions in the world group); ``rank_in_group``
    is this process's index among them, which is what decides its weight slice.
    """

    ranks: list[int]
    rank: int  # this process's global rank
    device_group: dist.ProcessGroup
    local_rank: int  # which device of this machine the process drives

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it (any shape).

        Every rank ends with the same sum. Identity for a group of one.
        """
        if self.world_size == 1:
            return tensor
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``, in rank order.

        [..., n, ...] on each rank -> [..., world_size * n, ...] on every rank.
        All ranks must pass the same shape. Identity for a group of one.
        """
        if self.world_size == 1:
            return tensor
        # all_gather fills one receive buffer per rank; torch.cat then lays them
        # side by side. Contiguous input: the collective sends raw memory.
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)


# Module state, as in vLLM: one world group and one tensor-parallel group per
# process, set once by the worker before it builds the model.
_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None


def default_backend(device: torch.device) -> str:
    """The torch.distributed backend for ``device``: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed_environment(
    world_size: int, rank: int, distributed_init_method: str, local_rank: int, backend: str
) -> None:
    """Join the world process group (blocks until all ``world_size`` processes have).

    ``distributed_init_method`` is where they meet, e.g. ``tcp://127.0.0.1:29500``
    (rank 0 listens there). Calling it again in an initialized process only
    checks that the world size agrees.
    """
    global _WORLD
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=COLLECTIVE_TIMEOUT,
        )
    if dist.get_world_size() != world_size:
        raise RuntimeError(
            f"torch.distributed is already initialized with world size {dist.get_world_size()}, "
            f"not {world_size}."
        )
    if _WORLD is None:
        world_group = dist.group.WORLD  # set by init_process_group
        assert world_group is not None
        _WORLD = GroupCoordinator(list(range(world_size)), rank, world_group, local_rank)


def initialize_model_parallel(tensor_model_parallel_size: int) -> None:
    """Split the world into groups of ``tensor_model_parallel_size`` consecutive ranks.

    With 4 processes and size 2: groups [0, 1] and [2, 3]. Every process must
    call ``new_group`` for *every* group, its own or not (torch.distributed's
    rule), and keeps the one it belongs to.
    """
    global _TP
    if _WORLD is None:
        raise RuntimeError("initialize_model_parallel needs init_distributed_environment first.")
    if _TP is not None:
        raise RuntimeError("The tensor-parallel group is already initialized.")
    world_size = _WORLD.world_size
    if tensor_model_parallel_size < 1 or world_size % tensor_model_parallel_size:
        raise ValueError(
            f"tensor_model_parallel_size ({tensor_model_parallel_size}) must divide the world "
            f"size ({world_size})."
        )
    for first in range(0, world_size, tensor_model_parallel_size):
        ranks = list(range(first, first + tensor_model_parallel_size))
        # The whole world needs no second communicator: reuse it.
        group = _WORLD.device_group if len(ranks) == world_size else dist.new_group(ranks)
        if _WORLD.rank in ranks:
            _TP = GroupCoordinator(ranks, _WORLD.rank, group, _WORLD.local_rank)


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group; RuntimeError before ``initialize_model_parallel``."""
    if _TP is None:
        raise RuntimeError("The tensor-parallel group is not initialized (a single-process run has none).")
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    """How many ranks split each weight: 1 when no group was initialized."""
    return _TP.world_size if _TP is not None else 1


def get_tensor_model_parallel_rank() -> int:
    """This process's slice of each weight: 0 when no group was initialized."""
    return _TP.rank_in_group if _TP is not None else 0


def destroy_model_parallel() -> None:
    """Forget the tensor-parallel group (and free its communicator if it had its own)."""
    global _TP
    if _TP is not None and _WORLD is not None and _TP.device_group is not _WORLD.device_group:
        dist.destroy_process_group(_TP.device_group)
    _TP = None


def destroy_distributed_environment() -> None:
    """Leave the world group; afterwards this process may join a new one."""
    global _WORLD
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
