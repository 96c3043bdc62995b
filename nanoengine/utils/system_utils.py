"""Helper processes: how nanoengine starts them, hands them their arguments and never orphans them.

Chapter 8 starts the engine core in a process of its own (``EngineCoreProc``);
chapter 6's tensor parallelism starts one worker process per rank
(``MultiprocExecutor``). Both use the same three moves, kept here once:

* **a fresh interpreter** (``python -c "...; main()"``), not ``fork`` (a forked
  child inherits locks held by the parent's other threads) and not
  ``multiprocessing``'s spawn (it re-imports the user's own script, which then
  needs an ``if __name__ == "__main__":`` guard);
* **its arguments on stdin**: a length, then the pickled objects
  (``encode_startup`` / ``read_startup``);
* **stdin stays open** while the parent lives. Only the parent holds the
  writing end, so the kernel closes it when the parent dies, however it dies
  (SIGKILL included): the child reads end-of-file and exits
  (``exit_when_parent_dies``).

vLLM 0.32 counterpart: vLLM starts its processes with ``multiprocessing`` and
gives each a "death pipe" read by a thread (``WorkerProc.monitor_death_pipe`` in
``vllm/v1/executor/multiproc_executor.py``); ``get_open_port`` and
``get_distributed_init_method`` are in ``vllm/utils/network_utils.py``.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import threading
from types import FrameType
from typing import Any

# The length prefix of the start-up message: one little-endian unsigned 64-bit int.
_LENGTH = struct.Struct("<Q")


def encode_startup(arguments: Any) -> bytes:
    """What a parent writes to a child's stdin: a length, then the pickled arguments."""
    payload = pickle.dumps(arguments)
    return _LENGTH.pack(len(payload)) + payload


def read_startup(fd: int) -> Any:
    """The child's side of ``encode_startup``: read the length, then the arguments."""
    (size,) = _LENGTH.unpack(read_exactly(fd, _LENGTH.size))
    return pickle.loads(read_exactly(fd, size))


def read_exactly(fd: int, size: int) -> bytes:
    """A pipe may deliver a message in pieces: read until ``size`` bytes are in."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError(f"stdin closed after {len(data)} of {size} start-up bytes")
        data += chunk
    return bytes(data)


def raise_system_exit(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handler: end the main thread's work with ``SystemExit`` (its ``finally`` blocks run)."""
    # Once is enough: a second SIGTERM (the parent-death watch, say) must not
    # interrupt the exit that the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)


def exit_when_parent_dies(parent_alive_fd: int, thread_name: str) -> None:
    """Watch our stdin, whose writing end only the parent holds: end-of-file means it is gone.

    The watch thread then sends this process SIGTERM, so a main thread that
    installed ``raise_system_exit`` unwinds as on an ordinary shutdown. Raw
    ``os.read`` on the descriptor, not ``sys.stdin``: a thread blocked inside
    Python's buffered reader would hold its lock while the interpreter shuts down.
    """

    def watch() -> None:
        while os.read(parent_alive_fd, 4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name=thread_name, daemon=True).start()


def get_open_port() -> int:
    """A TCP port on the loopback interface that nobody listens on right now.

    The port is free when this returns; another program could take it before
    the workers bind it, a race every launcher of this kind accepts.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def get_distributed_init_method(ip: str, port: int) -> str:
    """Where the ranks meet to set up torch.distributed: ``tcp://ip:port`` (rank 0 listens there)."""
    return f"tcp://{ip}:{port}"


def usable_cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe_exit_code(code: int | None) -> str:
    """A process's exit status in words: ``exit code 1``, or ``killed by SIGKILL`` for -9."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exit code {code}"
