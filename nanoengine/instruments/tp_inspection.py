"""What one tensor-parallel rank holds and sends: functions an executor runs on each worker.

Chapter 6 (tensor parallelism) runs these with ``collective_rpc`` on a live
engine: ``llm.llm_engine.engine_core.get_engine_core().model_executor
.collective_rpc(weight_shards)`` returns, in rank order, every weight's slice
on that rank. Each function takes the ``Worker`` first, as a function sent
through ``collective_rpc`` does, and lives in a module every worker process
can import (a function is sent by its module and name).

* ``rank_info``: the rank's process id, host and thread count;
* ``weight_shards`` (``model_weight_shards`` for any model built on a
  rank): each parameter's whole shape, its shape on this rank and
  the dimension it is split along;
* ``start_collective_tally`` / ``take_collective_tally`` /
  ``stop_collective_tally``: count the all-reduces and all-gathers a rank
  makes, with their bytes and the seconds they block for;
* ``time_all_reduce``: what one all-reduce costs when every rank arrives at
  once, the floor under the tally's seconds (the rest is waiting for a peer).

The tally taps the group's two methods from outside (``utils/method_taps.py``:
their bodies stay as they are) and only while it is on: an engine that never
asks pays nothing.
vLLM 0.32 counterpart: none; vLLM's profiler (``Worker.profile``) records
the same collectives in a torch trace.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from nanoengine.distributed.parallel_state import GroupCoordinator, get_tp_group
from nanoengine.instruments.method_taps import tap
from nanoengine.model_executor.layers.cpu_linear import PackableLinear
from nanoengine.model_executor.layers.linear import LinearBase
from nanoengine.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from nanoengine.worker.worker import Worker

COLLECTIVES = ("all_reduce", "all_gather")


@dataclass(frozen=True)
class RankInfo:
    """One worker process, as the executor's ``collective_rpc`` reaches it."""

    rank: int
    world_size: int
    pid: int
    host: str
    threads: int  # torch's intra-op threads: the rank's share of the cores
    device: str


def rank_info(worker: Worker) -> RankInfo:
    return RankInfo(
        rank=worker.rank,
        world_size=worker.world_size,
        pid=os.getpid(),
        host=socket.gethostname(),
        threads=torch.get_num_threads(),
        device=str(worker.device),
    )


@dataclass(frozen=True)
class WeightShard:
    """One parameter on one rank: the checkpoint's whole shape and this rank's slice of it.

    ``split_dim`` is the dimension cut into N slices (0: output rows of a
    [out, in] weight, or vocabulary rows; 1: input columns), None when every
    rank holds the whole tensor (norms, a row-parallel layer's bias).
    """

    name: str
    layer_type: str  # the owning module's class, e.g. "QKVParallelLinear"
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    split_dim: int | None


def _full_shape(module: nn.Module, param_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The parameter's shape in the checkpoint, read off the layer's own sizes."""
    if isinstance(module, LinearBase):
        return (module.output_size, module.input_size) if param_name == "weight" else (module.output_size,)
    if isinstance(module, VocabParallelEmbedding | ParallelLMHead):
        return (module.num_embeddings, *shape[1:])
    return shape


def _rank_shape(module: nn.Module, param: nn.Parameter) -> tuple[int, ...]:
    """The parameter's shape on this rank as the checkpoint lays it out: a weight
    packed for nanoengine's GEMM (panels, [out / P, in, P] in fp32) still reports
    the [out, in] slice it was packed from."""
    if isinstance(module, PackableLinear) and module.packed and param is module.weight:
        return (module.out_features, module.in_features)
    return tuple(param.shape)


def weight_shards(worker: Worker) -> list[WeightShard]:
    """Every parameter of this rank's loaded model (see ``model_weight_shards``)."""
    model = worker.model_runner.model if worker.model_runner is not None else None
    if model is None:
        raise RuntimeError("weight_shards needs a loaded model (after load_model).")
    return model_weight_shards(model)


def model_weight_shards(model: nn.Module) -> list[WeightShard]:
    """Every parameter of a model built on this rank, in the model's order.

    A parameter shared by two modules (a tied LM head's) is listed once; a
    model on the meta device works too, as only shapes are read.
    """
    shards, seen = [], set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            shape = _rank_shape(module, param)
            full = _full_shape(module, param_name, shape)
            # Padding can make a vocabulary slice times N exceed the vocabulary, so
            # the split dimension is the one whose size differs, not a product.
            differing = [dim for dim, (a, b) in enumerate(zip(full, shape, strict=True)) if a != b]
            shards.append(
                WeightShard(
                    name=f"{module_name}.{param_name}" if module_name else param_name,
                    layer_type=type(module).__name__,
                    full_shape=full,
                    shape=shape,
                    split_dim=differing[0] if differing else None,
                )
            )
    return shards


@dataclass
class CollectiveTally:
    """What one rank's collectives did since the tally was last taken.

    ``bytes`` counts the tensor each call was given (what the rank contributes);
    ``seconds`` is the wall time inside the call, waiting for the slowest peer
    included, which is what the rank's step loses to it.
    """

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0.0))

    @property
    def total_seconds(self) -> float:
        """Wall time in every collective together."""
        return sum(self.seconds.values())

    def record(self, collective: str, tensor: torch.Tensor, seconds: float) -> None:
        self.calls[collective] += 1
        self.bytes[collective] += tensor.numel() * tensor.element_size()
        self.seconds[collective] += seconds


# The tally of this process (one rank per process), None while off.
_TALLY: CollectiveTally | None = None


def _tap_timed(group: GroupCoordinator, collective: str) -> None:
    """Tap ``group.<collective>`` so that each call lands in the tally while one is on."""
    started: list[float] = []

    def begin(*_: object, **__: object) -> None:
        started.append(time.perf_counter())

    def end(_result: object, tensor: torch.Tensor, *_: object, **__: object) -> None:
        seconds = time.perf_counter() - started.pop()
        if _TALLY is not None:
            _TALLY.record(collective, tensor, seconds)

    tap(group, collective, before=begin, after=end)


def start_collective_tally(worker: Worker) -> None:
    """Count this rank's collectives from now on (a second start restarts the count)."""
    global _TALLY
    group = get_tp_group()
    for collective in COLLECTIVES:
        if collective not in vars(group):  # not tapped yet (a tap lives on the instance)
            _tap_timed(group, collective)
    _TALLY = CollectiveTally()


def take_collective_tally(worker: Worker) -> CollectiveTally:
    """The tally so far; counting goes on from zero."""
    global _TALLY
    if _TALLY is None:
        raise RuntimeError("start_collective_tally must run on the worker first.")
    tally, _TALLY = _TALLY, CollectiveTally()
    return tally


def stop_collective_tally(worker: Worker) -> None:
    """Stop counting and give the group back its own methods."""
    global _TALLY
    _TALLY = None
    group = get_tp_group()
    for collective in COLLECTIVES:
        vars(group).pop(collective, None)  # the class's own method shows through again


def time_all_reduce(worker: Worker, num_elements: int, repeats: int = 200) -> float:
    """Median seconds of an all-reduce of ``num_elements`` fp32 numbers, all ranks ready.

    Every rank must call it at once (``collective_rpc`` does): each call then
    starts with its peers already waiting, so the time is the collective's own.
    """
    group = get_tp_group()
    tensor = torch.ones(num_elements)
    for _ in range(10):  # warm-up: the first calls set up gloo's buffers
        group.all_reduce(tensor)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        group.all_reduce(tensor)
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2]
