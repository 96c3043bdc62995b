"""The live view on ``nanoengine serve``: an API server plugin that adds the ``/ui`` routes.

Chapter 8 (online serving). ``pyproject.toml`` names ``add_live_view`` under the
entry-point group ``nanoengine.api_server_plugins``; ``run_server`` calls it
with the app, the ``AsyncLLM`` and the serve arguments before uvicorn starts,
so the server's own code names no instrument. The page reads the engine core
(in its own process) through the utility calls the instruments' engine core
plugin offers. ``--api-key`` guards ``/ui/api/`` as it guards ``/v1``;
``--enable-ui-control`` allows the page's pause and step buttons.

vLLM 0.32 counterpart: none; vLLM's ``--middleware`` and the
``vllm.general_plugins`` group are its ways to add to a server from outside.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from nanoengine.instruments.live_view.app import UtilityFrameSource, live_view_router

if TYPE_CHECKING:
    from fastapi import FastAPI

    from nanoengine.engine.async_llm import AsyncLLM


def add_live_view(app: FastAPI, engine: AsyncLLM, args: argparse.Namespace) -> None:
    """Mount the page and its feed on ``app``."""
    source = UtilityFrameSource(engine.client.call_utility_async)
    app.include_router(live_view_router(source, allow_control=bool(getattr(args, "enable_ui_control", False))))
