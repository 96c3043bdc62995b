"""The chapter-1 walkthrough runs on a tiny model and prints both maps and the three roles."""

from __future__ import annotations

import pytest

from chapters import ch01_quickstart
from chapters._common import SEED_PROMPTS


def test_quickstart_prints_answers_maps_and_roles(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    ch01_quickstart.main(["--model", tiny_llama, "--max-tokens", "4"])
    out = capsys.readouterr().out
    for prompt in SEED_PROMPTS:
        assert repr(prompt) in out
    assert "LLM(...)      took" in out and "generate(...) took" in out
    assert "determine_available_memory" in out and "initialize_from_config" in out
    for code in ("EngineCore.step", "Scheduler.schedule", "KVCacheManager"):
        assert code in out
    assert "nanoengine/engine/core.py:" in out
