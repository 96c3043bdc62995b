"""Chapter 8's walkthrough runs on the tiny model and shows what it promises."""

from __future__ import annotations

import os

from chapters import ch08_serving


def test_walkthrough_serves_streams_times_and_aborts(tiny_llama: str) -> None:
    result = ch08_serving.main(["--model", tiny_llama, "--max-model-len", "512", "--max-tokens", "8"])
    assert result.core_pid != os.getpid()
    assert {"EngineCoreInput", "EngineCoreOutput", "MainThread"} <= set(result.core_threads)
    assert result.num_chunks >= 2
    whats = [what for _, _, what in result.timeline.events]
    assert any("EngineCoreRequest encoded" in what for what in whats)
    assert any("queued" in what for what in whats) and any("SSE chunk 1" in what for what in whats)
    assert result.aborted_status == "FINISHED_ABORTED" and result.blocks_free_after_abort
