"""Start ``nanoengine serve`` on a free port for a test, and make sure it is gone afterwards.

Servers bind 127.0.0.1 only. ``running_server`` yields the base URL and the
server's process; on exit it stops the server (SIGTERM, then SIGKILL) and
checks that no engine-core process it started outlives it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

API_KEY = "sk-nanoengine-test"
NANOENGINE = str(Path(sys.executable).parent / "nanoengine")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_run(count: int, tries: int = 50) -> int:
    """The first of ``count`` consecutive free ports: a KV block server listens on
    ``kv_port + rank``, so a tensor-parallel producer needs a run of them."""
    for _ in range(tries):
        first = free_port()
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue  # one of the run is taken: draw another start
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no run of {count} free ports on 127.0.0.1 in {tries} tries")


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (the engine core process of a server)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text() if (task / "children").exists() else ""
        children += [int(child) for child in text.split()]
    return children


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def wait_until(condition: object, seconds: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return False


@contextmanager
def running_server(model: str, *flags: str, api_key: str | None = API_KEY,
                   log: Path | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``log``: a file that receives the server's output (its access lines and warnings)."""
    with running_processes([serve_command(model, *flags, api_key=api_key)], log) as (started,):
        yield started


def serve_command(model: str, *flags: str, api_key: str | None = API_KEY) -> list[str]:
    """``nanoengine serve`` on a free port; ``{port}`` stands for it until ``running_processes`` fills it in."""
    args = [NANOENGINE, "serve", model, "--host", "127.0.0.1", "--port", "{port}", *flags]
    return args + (["--api-key", api_key] if api_key is not None else [])


@contextmanager
def running_processes(commands: list[list[str]], log: Path | None = None,
                      ports: list[int] | None = None) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """Start every command at once (``{port}`` in one is its own free port, or ``ports[i]``), wait
    until each answers ``/health``, yield ``(base URL, process)`` for each; on exit stop them all
    (SIGTERM, then SIGKILL) and check that no child process (an engine core, a rank) outlives them."""
    ports = ports or [free_port() for _ in commands]
    sink = None if log is None else log.open("ab")
    servers = [subprocess.Popen([arg.replace("{port}", str(port)) for arg in command], stdout=sink,
                                stderr=None if sink is None else subprocess.STDOUT)
               for command, port in zip(commands, ports)]
    if sink is not None:
        sink.close()  # each server holds its own copy of the file
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    children: dict[int, list[int]] = {}
    try:
        for url, server in zip(urls, servers):
            ready = wait_until(lambda: _healthy(url) or server.poll() is not None, 180, 0.25)
            assert ready and server.poll() is None, f"the server at {url} did not come up: {server.args}"
            children[server.pid] = descendant_pids(server.pid)
        yield list(zip(urls, servers))
    finally:
        for server in servers:
            children[server.pid] = children.get(server.pid) or descendant_pids(server.pid)
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
        for server in servers:
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        cores = [pid for pids in children.values() for pid in pids]
        leftovers = [pid for pid in cores if not wait_until(lambda pid=pid: not is_running(pid), 10)]
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"engine core processes outlived their server: {leftovers}"


def descendant_pids(pid: int) -> list[int]:
    """Children, grandchildren ... of ``pid`` (a server's engine core and its tensor-parallel ranks)."""
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in child_pids(parent)]
        found += children
        frontier = children
    return found


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def metric(base_url: str, name: str) -> float:
    """One sample's value from ``/metrics`` (the first line starting with ``name``)."""
    for line in httpx.get(f"{base_url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
