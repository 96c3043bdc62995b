"""Engine core plugins (nanoengine/plugins/, chapter 5): how the instruments reach every core.

The package metadata names one plugin, ``instruments``; ``NANOENGINE_PLUGINS`` filters by
name; a plugin that fails to load is logged and skipped; and an engine whose instruments
were left out says so when asked for a trace, instead of answering None.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from importlib.metadata import EntryPoint

import pytest

from nanoengine import LLM
from nanoengine import plugins
from nanoengine.instruments.plugin import attach_to_engine_core


@pytest.fixture(autouse=True)
def _fresh_plugin_cache() -> Iterator[None]:
    """Each test loads the plugins anew (the loader caches them per process)."""
    plugins.load_engine_core_plugins.cache_clear()
    yield
    plugins.load_engine_core_plugins.cache_clear()


def test_the_instruments_plugin_is_declared_and_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    assert plugins.load_engine_core_plugins() == {"instruments": attach_to_engine_core}


def test_the_environment_variable_keeps_only_the_plugins_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.PLUGINS_ENV, "")
    assert plugins.load_engine_core_plugins() == {}
    plugins.load_engine_core_plugins.cache_clear()
    monkeypatch.setenv(plugins.PLUGINS_ENV, " instruments , someone-elses ")
    assert list(plugins.load_engine_core_plugins()) == ["instruments"]


def test_a_plugin_that_fails_to_load_is_logged_and_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    group = plugins.ENGINE_CORE_PLUGINS_GROUP
    found = [
        EntryPoint("broken", "nanoengine_no_such_module:attach", group),
        EntryPoint("instruments", "nanoengine.instruments.plugin:attach_to_engine_core", group),
    ]
    monkeypatch.setattr(plugins, "entry_points", lambda group: found)
    with caplog.at_level(logging.ERROR, logger="nanoengine.plugins"):
        loaded = plugins.load_engine_core_plugins()
    assert list(loaded) == ["instruments"]
    assert any("'broken'" in record.getMessage() and "skipped" in record.getMessage() for record in caplog.records)


def test_a_trace_without_its_plugin_is_an_error_that_says_why(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugins.PLUGINS_ENV, "")
    llm = LLM(tiny_llama, trace=True, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    with pytest.raises(RuntimeError, match="plugin 'instruments' did not run") as raised:
        _ = llm.trace
    assert plugins.PLUGINS_ENV in str(raised.value)
    # Nothing was tapped either: the scheduler runs its own methods.
    scheduler = llm.llm_engine.engine_core.get_engine_core().scheduler
    assert "schedule" not in vars(scheduler)
