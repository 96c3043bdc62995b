"""Chapter 5's walkthrough runs, and its computed source map and state tour hold up."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from chapters import ch05_skeleton
from chapters.ch05_source_map import compute_drift, load_vllm_map
from chapters.ch05_state_tour import START, run_state_tour
from nanoengine.request import RequestStatus


def test_no_generate_prints_the_maps(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    ch05_skeleton.main(["--model", tiny_llama, "--no-generate"])
    out = capsys.readouterr().out
    for expected in (
        "LLM(...) prepares",
        "engine_core: EngineCore",
        "Source map",
        "vLLM 0.32.0",
        "handle_blocked_waiting_request",
        "FINISHED_REPETITION",
        "what changed",
        "Drift",
    ):
        assert expected in out, expected


def test_json_tree_carries_the_vllm_counterparts(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    ch05_skeleton.main(["--model", tiny_llama, "--json"])
    data = json.loads(capsys.readouterr().out)
    root = data["tree"]
    assert root["class_name"] == "LLM" and root["vllm"]["defined_at"] == "entrypoints/llm.py:63"
    core = root["children"][0]["children"][3]["children"][0]
    assert core["class_name"] == "EngineCore" and core["vllm"]["class"] == "vllm.v1.engine.core.EngineCore"
    scheduler = next(child for child in core["children"] if child["attr"] == "scheduler")
    assert scheduler["vllm"]["created_at"] == "v1/engine/core.py:174"
    assert scheduler["defined_at"]["path"] == "nanoengine/core/sched/scheduler.py"


def test_hybrid_model_tree_shows_the_coordinator_and_its_managers(
    tiny_model_factory: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 15: on Qwen3.5 (3 Gated DeltaNet layers, 1 attention layer) the tree has the
    hybrid coordinator, one full-attention manager and three state managers over one pool."""
    ch05_skeleton.main(["--model", tiny_model_factory("qwen3_5"), "--json"])
    core = json.loads(capsys.readouterr().out)["tree"]["children"][0]["children"][3]["children"][0]
    scheduler = next(child for child in core["children"] if child["attr"] == "scheduler")
    coordinator = scheduler["children"][0]["children"][0]
    assert coordinator["class_name"] == "HybridKVCacheCoordinator"
    managers = [child["class_name"] for child in coordinator["children"]]
    assert managers == ["FullAttentionManager", "MambaManager", "MambaManager", "MambaManager"]


def test_short_generate_reaches_all_twelve_states(
    tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ch05_skeleton.main(["--model", tiny_llama, "--max-tokens", "8"])
    out = capsys.readouterr().out
    assert "states reached: 12/12" in out
    assert "stateDiagram-v2" in out and "RUNNING --> PREEMPTED" in out
    assert "EngineCore.step() anatomy" in out and "overlap" in out


def test_state_tour_transitions(tiny_llama: str, tmp_path: Path) -> None:
    tour = run_state_tour(tiny_llama, str(tmp_path), max_tokens=8)
    assert tour.states_reached() == set(RequestStatus)
    transitions = tour.transitions
    # The promotions of the blocked states, and preemption's round trip.
    for pair in [
        ("WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING"),
        ("WAITING_FOR_REMOTE_KVS", "WAITING"),
        ("RUNNING", "WAITING_FOR_STREAMING_REQ"),
        ("RUNNING", "PREEMPTED"),
        ("PREEMPTED", "RUNNING"),
        (START, "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"),
    ]:
        assert pair in transitions, pair
    assert tour.skipped_prefill_tokens > 0
    # Every observed history is a walk that ends in a finished state.
    for request in tour.requests:
        assert request.request.is_finished(), request.name


def test_drift_is_computed_from_the_data_file() -> None:
    vllm_map = load_vllm_map(prefer_installed=False)
    drifts = {d.name: d for d in compute_drift(vllm_map)}
    assert drifts["LLMEngine.renderer"].delta == 98 - 91
    assert drifts["Scheduler.schedule()"].delta == 591 - 561
    assert drifts["class KVCacheManager"].delta == 131 - 134
