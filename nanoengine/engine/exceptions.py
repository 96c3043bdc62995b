"""What the front end raises when the engine core behind it is gone.

Chapter 8 (online serving). With the core in another process, a crash there
(a kill, an out-of-memory, a bug) must reach the caller as an error it can
name, never as a ``get_output()`` that waits forever. The client's monitor
thread notices the process exit (its output thread, a frame it cannot read)
and every waiting call raises ``EngineDeadError``; a server answers every
request with a 500 from then on, and ``/health`` with a 503.

vLLM 0.32 counterpart: ``vllm/v1/engine/exceptions.py`` (``EngineDeadError``,
``EngineGenerateError``).
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process has exited; no request can make progress any more."""

    def __init__(self, detail: str = "") -> None:
        message = "The engine core process has died" + (f": {detail}" if detail else ".")
        super().__init__(message + " Restart the engine (or the server) to continue.")
