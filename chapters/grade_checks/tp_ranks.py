"""Run a function on N real tensor-parallel ranks and collect what each returns.

Chapter 6 (tensor parallelism). Exercise 6.2's grader builds a tiny model's
two ranks with this, each rank loading its slice through the student's
``weight_loader`` (sent to it as a ``ShippedFunction``);
``tests/test_parallel_layers.py`` and ``tests/test_parallel_state.py`` test
every parallel layer and the collectives with it. vLLM 0.32 counterpart:
none (a helper of the tests and the grader).

Each rank is a spawned process that joins a gloo process group over
tcp://127.0.0.1 (a free port), sets up the TP group, runs the function and
sends its result back. Bounded: a rank that raises fails the call with its
traceback, a rank that dies or hangs fails it within ``timeout`` seconds, and
every rank is gone (joined, or killed) before the call returns.

Results cross the process boundary as numpy arrays (pickled by value), not
torch tensors, whose pickling shares memory with a process that may already
have exited.
"""

from __future__ import annotations

import importlib
import marshal
import multiprocessing as mp
import queue
import socket
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanoengine.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def to_numpy(obj: Any) -> Any:
    """Tensors -> numpy arrays, through dicts, lists and tuples; anything else unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {key: to_numpy(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_numpy(value) for value in obj)
    return obj


def to_torch(obj: Any) -> Any:
    """The inverse of ``to_numpy``."""
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {key: to_torch(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_torch(value) for value in obj)
    return obj


# Rendezvous ports drawn before a run gives up on a port another process took first.
PORT_DRAWS = 3


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, init_method: str, args: tuple[Any, ...], results: Any
) -> None:
    # One thread per rank: two ranks on a 2-core machine, no oversubscription.
    torch.set_num_threads(1)
    try:
        init_distributed_environment(world_size, rank, init_method, local_rank=rank, backend="gloo")
        initialize_model_parallel(world_size)
        with torch.no_grad():
            payload = to_numpy(fn(*to_torch(args)))
        results.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 (report everything to the parent, then exit)
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 120.0) -> list[Any]:
    """``fn(*args)`` on each of ``world_size`` ranks; returns the results in rank order.

    ``fn`` must be a module-level function (spawn sends it by name); ``args``
    may hold tensors. RuntimeError, naming the rank, on a failed, dead or hung rank.
    The rendezvous port is free when it is drawn, but the ranks bind it seconds
    later, once torch is imported; if another process took it in between, the
    run starts again on a new port (at most ``PORT_DRAWS`` times).
    """
    for _ in range(PORT_DRAWS - 1):
        try:
            return _run_on_ranks_once(fn, args, world_size, timeout, f"tcp://127.0.0.1:{free_port()}")
        except RuntimeError as error:
            if "EADDRINUSE" not in str(error):
                raise
    return _run_on_ranks_once(fn, args, world_size, timeout, f"tcp://127.0.0.1:{free_port()}")


def _run_on_ranks_once(fn: Callable[..., Any], args: tuple[Any, ...], world_size: int, timeout: float,
                       init_method: str) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, init_method, to_numpy(args), results),
            daemon=True,  # killed with this process, should it die first
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(collected))} hung")
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} raised:\n{payload}")
            collected[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10)
        for proc in procs:
            if proc.is_alive():  # stuck in a collective its failed peer never joined
                proc.kill()
                proc.join(timeout=5)
        results.close()
    if any(proc.is_alive() for proc in procs):
        raise RuntimeError("a rank process outlived the call")
    return [to_torch(collected[rank]) for rank in range(world_size)]


@dataclass(frozen=True)
class ShippedFunction:
    """A function sent to a spawned rank by value: its compiled code, rebuilt there
    against its own module's globals.

    Spawn sends a function by name, and a rank imports its module afresh: the
    grader's swap of a student's function into a class (done in the grading
    process only) is not there. Exercise 6.2's ranks are sent the function
    itself, to put in place before they build a model: a student's (defined
    in ``chapters/exercises/ex6_2.py``, which the rank imports too) or a
    planted mistake of the tests (compiled in the reference module's
    namespace) alike.
    """

    module: str
    code: bytes  # marshal of the code object: the rank runs this very interpreter
    defaults: tuple[Any, ...] | None

    @classmethod
    def of(cls, function: Callable[..., Any]) -> ShippedFunction:
        if function.__closure__:
            raise ValueError(f"{function.__qualname__} reads variables of an enclosing function; "
                             "write it at the top level of its module.")
        return cls(function.__module__, marshal.dumps(function.__code__), function.__defaults__)

    def rebuild(self) -> Callable[..., Any]:
        code = marshal.loads(self.code)
        namespace = vars(importlib.import_module(self.module))
        return types.FunctionType(code, namespace, code.co_name, self.defaults)
