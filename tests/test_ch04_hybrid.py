"""Chapter 4's hybrid run (experiment 4) on a tiny random Qwen3.5, and every group's block table.

What the walkthrough promises: the page-size arithmetic it prints is the
engine's own; while one request runs, its full-attention table grows with the
sequence, one block per ``block_size`` tokens, while each state group keeps one
block whose id never changes; when it finishes, every block is back in the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import pytest

from chapters import ch04_groups
from nanoengine.utils.math_utils import cdiv

# Asked for 8 tokens a block; a tiny Qwen3.5 state (5,632 B) needs 16 tokens of
# K and V (512 B each) per page, so the engine raises it to 16.
ASKED_BLOCK_SIZE = 8
# Chunks of 8 tokens: the 31-token prompt is prefilled over four steps.
CHUNK = 8


@pytest.mark.parametrize(("pattern", "num_state_groups"), [("qwen3_5", 3), ("qwen3_5-alt", 1)])
def test_attention_table_grows_state_blocks_stay(
    tiny_model_factory: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
    pattern: str,
    num_state_groups: int,
) -> None:
    run = ch04_groups.hybrid_run(tiny_model_factory(pattern), ASKED_BLOCK_SIZE, CHUNK)
    assert run.block_size == 16
    steps = run.steps
    prompt_len = 2 * run.block_size - 1
    # Chunked prefill, then decode steps until the last one before the request finishes.
    assert [s.num_computed_tokens for s in steps] == [8, 16, 24, 31, 32, 33]
    counts = [len(s.attention_block_ids) for s in steps]
    assert counts == [cdiv(s.num_computed_tokens, run.block_size) for s in steps] == [1, 1, 2, 2, 2, 3]
    # A grown table keeps its old blocks and appends new ones.
    for before, after in pairwise(steps):
        assert after.attention_block_ids[: len(before.attention_block_ids)] == before.attention_block_ids
    # One state block per state group, the same ids at every step, none shared with attention.
    state_ids = steps[0].state_block_ids
    assert len(state_ids) == len(set(state_ids)) == num_state_groups
    assert all(s.state_block_ids == state_ids for s in steps)
    assert not set(state_ids) & set(steps[-1].attention_block_ids)
    # Every block the request holds comes out of the one pool, and all come back.
    for step in steps:
        held = len(step.attention_block_ids) + len(step.state_block_ids)
        assert step.num_free_blocks == run.num_usable_blocks - held
    assert run.num_free_blocks_after == run.num_usable_blocks
    assert steps[3].num_computed_tokens == prompt_len

    out = capsys.readouterr().out
    # The arithmetic as printed, from the live config: 2 KV heads x head_dim 32 x 4 B = 512 B a token.
    for expected in (
        "2 x 2 KV heads x head_dim 32 x 4 B",
        f"max(asked {ASKED_BLOCK_SIZE}, 16 x cdiv(5,632, 16 x 512)) = max({ASKED_BLOCK_SIZE}, 16 x 1)",
        "8,192 - 5,632",
        "1,073,741,824 B // ",
        "state, 1 block per request",
        "full attention, 16 tokens/block",
    ):
        assert expected in out, expected
