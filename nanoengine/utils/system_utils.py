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
  (``exit_when_parent_dies``). The watch also notices the child being handed
  to a new parent (``getppid`` changes), in case anything else still holds
  that writing end, and it does not trust the main thread to finish: a process
  still alive a grace period after its parent's death ends itself.

vLLM 0.32 counterpart: vLLM starts its processes with ``multiprocessing`` and
gives each a "death pipe" read by a thread (``WorkerProc.monitor_death_pipe`` in
``vllm/v1/executor/multiproc_executor.py``); ``get_open_port`` and
``get_distributed_init_method`` are in ``vllm/utils/network_utils.py``.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
from types import FrameType
from typing import Any

# The length prefix of the start-up message: one little-endian unsigned 64-bit int.
_LENGTH = struct.Struct("<Q")
# Once the parent is gone, the main thread gets this long to unwind (SIGTERM,
# then its ``finally`` blocks); a process still alive after it exits at once.
PARENT_DEATH_GRACE_S = 5.0
# How often the parent watch also asks whether the process has a new parent.
_PARENT_POLL_S = 0.5


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
    installed ``raise_system_exit`` unwinds as on an ordinary shutdown. Two
    things can defeat that on a busy machine, so the watch guards both:

    * the end-of-file never comes if another process still holds the writing
      end (a child forked by the parent before it died): the watch also looks
      at ``os.getppid()`` every ``_PARENT_POLL_S`` and treats a new parent (the
      orphan's adoption by init) as the old one's death;
    * the ``SystemExit`` may be lost (raised inside a finalizer, which Python
      only prints) or the unwinding may hang (a socket's linger, a worker that
      ignores us): after ``PARENT_DEATH_GRACE_S`` the watch ends the process
      with ``os._exit``. Its own children watch their stdin in turn.

    Raw ``os.read`` on the descriptor, not ``sys.stdin``: a thread blocked inside
    Python's buffered reader would hold its lock while the interpreter shuts down.
    """
    parent = os.getppid()

    def parent_is_gone() -> bool:
        readable, _, _ = select.select([parent_alive_fd], [], [], _PARENT_POLL_S)
        if readable and not os.read(parent_alive_fd, 4096):
            return True  # end-of-file: no process holds the writing end any more
        return os.getppid() != parent

    def watch() -> None:
        while not parent_is_gone():
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PARENT_DEATH_GRACE_S)
        print(f"nanoengine: process {os.getpid()} still running {PARENT_DEATH_GRACE_S:g} s after its parent "
              f"{parent} died; exiting now.", file=sys.stderr, flush=True)
        os._exit(1)

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
