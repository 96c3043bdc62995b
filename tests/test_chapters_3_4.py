"""The chapter 3 and 4 walkthroughs run end to end on a tiny model and show what they claim."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from chapters import ch03_scheduler, ch04_kv_cache


def test_ch03_budget_chunks_mixing_and_priority(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = ch03_scheduler.main(
        ["--model", tiny_llama, "--max-num-batched-tokens", "32", "--block-size", "8"]
    )
    # The short request took 8 tokens of step 0; each later step spends 1 on its decode.
    assert sum(result.chunk_sizes) == result.long_prompt_len == 3 * 32 + 16
    assert result.chunk_sizes[0] == 32 - 8 and max(result.chunk_sizes) <= 32
    assert len(result.chunk_sizes) >= 4 and result.mixed_steps >= 2
    assert result.priority_preemptions == [("low", "urgent")]
    assert result.finish_order == ["urgent", "low"]
    out = capsys.readouterr().out
    assert "chunks" in out and "priority" in out and "low:P0-29" in out


def test_ch04_sharing_preemption_lru_and_hybrid(
    tiny_llama: str,
    tiny_model_factory: Callable[..., str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    timeline = tmp_path / "ch04_timeline.png"
    hybrid_model = tiny_model_factory("qwen3_5")  # experiment 4 (tests/test_ch04_hybrid.py looks closer)
    plain = ["--model", tiny_llama, "--timeline", str(timeline), "--block-size", "8"]
    result = ch04_kv_cache.main([*plain, "--hybrid-model", hybrid_model])
    assert len(result.shared_block_ids) == 3  # the 3-block system prompt, held by both tables
    assert result.prefix_hit_rate > 0.4
    assert result.num_preemptions >= 1
    assert result.resume_hit_tokens > 0  # the prefix cache spared part of the recompute
    # LRU: the unrelated request evicted the first request's *last* full block only.
    assert result.evicted_block_ids == result.free_queue_head[:1]
    assert result.rerun_hit_tokens == 2 * 8
    assert sorted(Path(p).suffix for p in result.timeline_paths) == [".png", ".svg"]
    assert timeline.exists() and timeline.with_suffix(".svg").exists()
    # Experiment 4 ran with the chapter's defaults: the 31-token prompt in one 128-token step.
    assert result.hybrid is not None and result.hybrid.block_size == 16
    assert [len(step.state_block_ids) for step in result.hybrid.steps] == [3] * len(result.hybrid.steps)
    assert result.hybrid.num_free_blocks_after == result.hybrid.num_usable_blocks
    # Experiment 5, the facts ch04.md's sliding-window section states: a full group and three sliding
    # ones; a decode step's sliding table holds at most window / block_size + 1 = 5 real blocks, a
    # 16-token chunk's cdiv(15 + 16, 4) + 1 = 9; the hit of 36 tokens takes 9 full blocks and, in
    # each sliding group, only the cdiv(15, 4) = 4 blocks before its end.
    sliding = result.sliding
    assert sliding.group_kinds == ["full", "sliding", "sliding", "sliding"]
    decodes = [s for s in sliding.steps if s.num_computed_tokens > 40]
    assert max(sum(b != 0 for b in s.sliding_table) for s in decodes) == 5
    assert max(sum(b != 0 for b in s.sliding_table) for s in sliding.steps) <= 9
    assert len(sliding.steps[-1].full_table) == 16  # 62 tokens computed, slots for 64: every block kept
    assert sliding.hit_tokens == 36 and [sum(b != 0 for b in t) for t in sliding.hit_tables] == [9, 4, 4, 4]
    assert sliding.same_tokens and sliding.num_free_blocks_after == sliding.num_usable_blocks
    out = capsys.readouterr().out
    assert "block table of request 'a'" in out and "preemption" in out and "hit rate" in out
    assert "this engine's arithmetic" in out and "4 KV cache groups" in out
