"""Shared by the tests that start worker processes: is this one gone, which are ours, a checkpoint no rank can load."""

from __future__ import annotations

import time
from pathlib import Path

import psutil


def descendants() -> set[int]:
    """Live (non-zombie) descendants of this test process."""
    alive = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def pid_gone(pid: int, seconds: float) -> bool:
    """True once ``pid`` has exited (a zombie counts as gone), polling for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def broken_checkpoint(model_dir: str, tmp_path: Path) -> Path:
    """A copy of ``model_dir`` (links) whose weights file is garbage: every rank fails to load it."""
    broken = tmp_path / "broken-weights"
    broken.mkdir()
    for item in Path(model_dir).iterdir():
        (broken / item.name).symlink_to(item)
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    return broken
