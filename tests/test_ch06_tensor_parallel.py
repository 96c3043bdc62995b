"""Chapter 6's tensor-parallelism walkthrough on a live two-rank engine.

``python -m chapters.ch06_construction --tensor-parallel-size 2`` with the
default model: SmolLM2's 9 heads do not split over 2, so the walkthrough shows
the refusal and goes on with its stand-in, here the tiny Llama (4 heads over 2
KV heads) in place of Qwen3-0.6B, with the same dummy weights. Then: the
executor and why, the two worker processes, every weight's slice on each rank,
and the collectives of every step counted on both ranks against the formula.
"""

from __future__ import annotations

import os

import pytest

from chapters import ch06_construction, ch06_tensor_parallel
from chapters.ch06_tensor_parallel import TensorParallelResult, shard_rows, tally_mismatches
from tests.process_helpers import pid_gone


@pytest.mark.default_model
def test_tp2_walkthrough_refuses_smollm2_then_shows_ranks_shards_and_collectives(
    default_model_path: str, tiny_llama: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ch06_tensor_parallel, "DEFAULT_MODEL_STAND_IN", tiny_llama)
    result = ch06_construction.main(
        ["--tensor-parallel-size", "2", "--max-tokens", "3", "--max-model-len", "128", "--max-num-batched-tokens", "128"]
    )
    assert isinstance(result, TensorParallelResult)
    out = capsys.readouterr().out
    assert "tensor_parallel_size (2) must divide the number of attention heads (9)" in out
    assert result.model == tiny_llama

    # 1. The executor, and the component tree with both workers.
    assert (result.backend, result.executor_class) == ("mp", "MultiprocExecutor")
    assert "left unset" in result.backend_reason and "tensor_parallel_size=2" in result.backend_reason
    assert "workers[0]: WorkerProcHandle" in result.engine_tree and "workers[1]: WorkerProcHandle" in result.engine_tree

    # 2. Two processes, neither this one, each with its rank.
    pids = [info.pid for info in result.ranks]
    assert [info.rank for info in result.ranks] == [0, 1] and {info.world_size for info in result.ranks} == {2}
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for pid in pids:
        assert f"pid={pid}" in result.engine_tree
        assert pid_gone(pid, 10.0), f"worker {pid} outlived the walkthrough"

    # 3. Every weight: the ranks' slices have one shape, and N of them make the whole.
    splits = {}
    for pattern, count, per_rank in shard_rows(result.shards):
        first = per_rank[0]
        assert {shard.shape for shard in per_rank} == {first.shape}, pattern
        if first.split_dim is None:
            assert first.shape == first.full_shape, pattern
        else:
            whole = list(first.shape)
            whole[first.split_dim] *= 2  # the tiny vocabulary (320) splits evenly: no padding
            assert tuple(whole) == first.full_shape, pattern
        splits[pattern.rsplit(".", 2)[-2]] = (first.split_dim, count)
    assert splits["qkv_proj"] == (0, 2) and splits["gate_up_proj"] == (0, 2)  # column-parallel, both layers
    assert splits["o_proj"] == (1, 2) and splits["down_proj"] == (1, 2)  # row-parallel
    assert splits["input_layernorm"] == (None, 2) and splits["embed_tokens"] == (0, 1)

    # 4. Collectives: 2 per layer + the embedding's all-reduce, 1 all-gather, on both ranks, every step.
    assert (result.expected_all_reduces, result.expected_all_gathers) == (5, 1)
    assert tally_mismatches(result) == []
    prompt_tokens = sum(len(ids) for ids in ch06_tensor_parallel.PROMPT_TOKEN_IDS)
    assert [step.num_tokens for step in result.steps] == [prompt_tokens, 3, 3]  # a prefill, then 2 decodes
    assert all(0.0 < step.share(0) < 1.0 for step in result.steps)
    assert [len(ids) for ids in result.output_token_ids] == [3, 3, 3]
    assert "every step matched the formula on every rank" in out
    # The floor under the collectives' seconds: one all-reduce with both ranks ready.
    assert 0.0 < result.idle_all_reduce_seconds < 1.0 and result.decode_tokens == 3
    assert "with both ranks ready takes" in out and "waiting for the other rank" in out


@pytest.mark.default_model
def test_a_model_named_by_the_user_that_cannot_split_is_refused_as_it_is(default_model_path: str) -> None:
    # Only the default model (by its short name) has a stand-in: a path gets the plain error,
    # before any process starts.
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide the number of attention heads \(9\)"):
        ch06_tensor_parallel.build_engine(default_model_path, 2, None, {}, default_model="SmolLM2-135M-Instruct")
