"""Run a function on N real tensor-parallel ranks and collect what each returns.

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

import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
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
    may hold tensors. AssertionError on a failed, dead or hung rank.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
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
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(collected))} hung")
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise AssertionError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if not ok:
                raise AssertionError(f"rank {rank} raised:\n{payload}")
            collected[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10)
        for proc in procs:
            if proc.is_alive():  # stuck in a collective its failed peer never joined
                proc.kill()
                proc.join(timeout=5)
        results.close()
    assert not any(proc.is_alive() for proc in procs), "a rank process outlived the call"
    return [to_torch(collected[rank]) for rank in range(world_size)]
