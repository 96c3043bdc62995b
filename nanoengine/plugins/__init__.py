"""Plugins: code an installation adds to every engine core, found by package metadata.

Chapter 5 (engine skeleton). A plugin is a function that a package names under
the entry-point group ``nanoengine.engine_core_plugins`` in its metadata (its
``pyproject.toml``). Each ``EngineCore`` calls every plugin once, with itself,
at the end of its constructor: in this process, or in the core's own process
(chapter 8) and in every other process that builds a core. The engine never
imports a plugin by name; it only asks the package metadata which exist.
``NANOENGINE_PLUGINS`` (names, comma-separated) keeps only those listed; set
to an empty string it keeps none.

A second group, ``nanoengine.api_server_plugins``, reaches ``nanoengine serve``
(chapter 8): each is called with the app, the engine and the serve arguments
before the server starts. The instruments add the live view's page there
(``/ui``, ``nanoengine/instruments/live_view/``).

nanoengine's own instruments (``nanoengine/instruments/``: the step tracer, the
invariant checks, the component tree of a core in another process) reach the
engine this way, so that the engine's code holds none of them.

vLLM 0.32 counterpart: ``vllm/plugins/__init__.py`` (``load_general_plugins``,
the ``vllm.general_plugins`` group, ``VLLM_PLUGINS``), which ``EngineCore.__init__``
calls too. vLLM calls a general plugin with no argument, once per process, and
the plugin registers things (a model, a platform); here a plugin also gets the
core it joins, so that it can watch that core's scheduler.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

logger = logging.getLogger(__name__)

ENGINE_CORE_PLUGINS_GROUP = "nanoengine.engine_core_plugins"
# Chapter 8: ``nanoengine serve`` calls these with its app before serving (the live view's page).
API_SERVER_PLUGINS_GROUP = "nanoengine.api_server_plugins"
PLUGINS_ENV = "NANOENGINE_PLUGINS"

# Called with the EngineCore it joins. Typed loosely on purpose: this module sits
# below the engine and names nothing of it.
EngineCorePlugin = Callable[[Any], None]
# Called with the FastAPI app, the AsyncLLM and the parsed serve arguments.
ApiServerPlugin = Callable[[Any, Any, Any], None]


def _allowed_names() -> set[str] | None:
    """The names ``NANOENGINE_PLUGINS`` lists; None (all of them) when it is unset."""
    listed = os.environ.get(PLUGINS_ENV)
    if listed is None:
        return None
    return {name.strip() for name in listed.split(",") if name.strip()}


@functools.cache
def load_engine_core_plugins() -> dict[str, EngineCorePlugin]:
    """Every allowed engine core plugin, by name, loaded once per process."""
    return _load_group(ENGINE_CORE_PLUGINS_GROUP)


@functools.cache
def load_api_server_plugins() -> dict[str, ApiServerPlugin]:
    """Every allowed API server plugin, by name, loaded once per process."""
    return _load_group(API_SERVER_PLUGINS_GROUP)


def _load_group(group: str) -> dict[str, Callable[..., None]]:
    """Every allowed plugin of ``group``, by name.

    A plugin that fails to import is logged and left out: a broken add-on must
    not stop the engine from starting.
    """
    allowed = _allowed_names()
    plugins: dict[str, Callable[..., None]] = {}
    for entry in entry_points(group=group):
        if allowed is not None and entry.name not in allowed:
            continue
        try:
            plugins[entry.name] = entry.load()
        except Exception:
            logger.exception("Plugin %r of %s (%s) failed to load; skipped.", entry.name, group, entry.value)
    return plugins
