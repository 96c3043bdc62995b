"""parallel_state and the communication ops: one process (nothing initialized) and two real ranks.

Also the arithmetic of the split (``distributed/utils.py``): KV heads per rank,
the first KV head of each rank, and ``check_tensor_parallel_size``, which the
engine calls before it starts any process.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import LlamaConfig

from chapters.grade_checks.tiny_model import tiny_config
from chapters.grade_checks import tp_ranks
from chapters.grade_checks.tp_ranks import run_on_ranks
from nanoengine.distributed import parallel_state
from nanoengine.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from nanoengine.distributed.parallel_state import (
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from nanoengine.distributed.utils import check_tensor_parallel_size, first_kv_head_of_rank, kv_heads_per_rank
from nanoengine.instruments.tp_inspection import (
    start_collective_tally,
    stop_collective_tally,
    take_collective_tally,
)
from nanoengine.worker.worker import Worker


def test_nothing_initialized_means_one_rank_and_identity_ops() -> None:
    assert not model_parallel_is_initialized()
    assert (get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()) == (1, 0)
    with pytest.raises(RuntimeError, match="not initialized"):
        get_tp_group()
    with pytest.raises(RuntimeError, match="init_distributed_environment first"):
        initialize_model_parallel(1)
    t = torch.arange(6.0).view(2, 3)
    assert tensor_model_parallel_all_reduce(t) is t
    assert tensor_model_parallel_all_gather(t, dim=0) is t


def collectives_on_a_rank() -> dict[str, Any]:
    """Rank side: what the group says, and what the two collectives return."""
    group = get_tp_group()
    rank = group.rank_in_group
    mine = torch.full((2, 3), float(rank + 1))
    gathered_last = tensor_model_parallel_all_gather(torch.full((2, 1), float(rank)), dim=-1)
    gathered_first = group.all_gather(torch.full((1, 3), float(rank)), dim=0)
    reduced = tensor_model_parallel_all_reduce(mine)
    out = {
        "rank": rank,
        "world_size": group.world_size,
        "tp": (get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()),
        "in_place": reduced is mine,
        "reduced": reduced,
        "gathered_last": gathered_last,
        "gathered_first": gathered_first,
        "pid": os.getpid(),
    }
    # The chapter-6 tally: counts only while on, then gives the group its methods back.
    no_worker = cast(Worker, None)  # the tally reads the process's group, not the worker
    start_collective_tally(no_worker)
    tensor_model_parallel_all_reduce(torch.ones(4, 8))  # 128 bytes
    group.all_gather(torch.ones(2, 3), dim=0)  # 24 bytes
    tally = take_collective_tally(no_worker)
    after_take = take_collective_tally(no_worker)
    stop_collective_tally(no_worker)
    out["tally"] = (tally.calls, tally.bytes, after_take.calls, sorted(vars(group)))
    with pytest.raises(RuntimeError, match="start_collective_tally must run"):
        take_collective_tally(no_worker)
    try:
        initialize_model_parallel(2)
    except RuntimeError as err:
        out["second_init"] = str(err)
    # Forgetting the group puts the process back on the one-rank paths.
    destroy_model_parallel()
    out["after_destroy"] = (model_parallel_is_initialized(), get_tensor_model_parallel_world_size())
    with pytest.raises(ValueError, match=r"\(3\) must divide the world size \(2\)"):
        initialize_model_parallel(3)
    # Groups of one inside a world of two: every rank alone, collectives are identities.
    initialize_model_parallel(1)
    alone = get_tp_group()
    out["groups_of_one"] = (alone.world_size, alone.rank_in_group, alone.ranks)
    return out


def test_two_ranks_form_a_group_and_reduce_and_gather() -> None:
    ranks = run_on_ranks(collectives_on_a_rank, world_size=2)
    for rank, got in enumerate(ranks):
        assert (got["rank"], got["world_size"], got["tp"]) == (rank, 2, (2, rank))
        assert got["in_place"]
        torch.testing.assert_close(got["reduced"], torch.full((2, 3), 3.0))  # 1 + 2
        torch.testing.assert_close(got["gathered_last"], torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
        torch.testing.assert_close(got["gathered_first"], torch.tensor([[0.0] * 3, [1.0] * 3]))
        assert "already initialized" in got["second_init"]
        assert got["after_destroy"] == (False, 1)
        assert got["groups_of_one"] == (1, 0, [rank])
        calls, sizes, after_take, attributes = got["tally"]
        assert calls == {"all_reduce": 1, "all_gather": 1} and sizes == {"all_reduce": 128, "all_gather": 24}
        assert after_take == {"all_reduce": 0, "all_gather": 0}  # taking starts the count again
        assert "all_reduce" not in attributes and "all_gather" not in attributes  # stopped: methods restored
    # run_on_ranks joined (reaped) both: the rank processes are gone.
    assert not any(Path(f"/proc/{got['pid']}").exists() for got in ranks)
    assert not parallel_state.model_parallel_is_initialized()  # this process never joined


# ---- the split arithmetic -------------------------------------------------------


@pytest.mark.parametrize(
    "kv_heads,tp,per_rank,first_heads",
    [
        (8, 2, 4, [0, 4]),  # split: 4 each
        (3, 3, 1, [0, 1, 2]),  # SmolLM2-135M at TP=3: one each
        (2, 4, 1, [0, 0, 1, 1]),  # replicated: ranks 0, 1 share head 0
        (1, 2, 1, [0, 0]),  # multi-query: every rank holds the one head
    ],
)
def test_kv_heads_split_or_replicated(kv_heads: int, tp: int, per_rank: int, first_heads: list[int]) -> None:
    assert kv_heads_per_rank(kv_heads, tp) == per_rank
    assert [first_kv_head_of_rank(kv_heads, tp, rank) for rank in range(tp)] == first_heads


def test_check_tensor_parallel_size_names_both_numbers() -> None:
    smollm = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    check_tensor_parallel_size(smollm, 3)
    check_tensor_parallel_size(smollm, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide the number of attention heads \(9\)"):
        check_tensor_parallel_size(smollm, 2)
    six_heads = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=64)
    with pytest.raises(ValueError, match=r"\(2\) must divide the number of KV heads \(3\)"):
        check_tensor_parallel_size(six_heads, 2)
    odd_mlp = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=130)
    with pytest.raises(ValueError, match=r"\(4\) must divide the MLP's intermediate_size \(130\)"):
        check_tensor_parallel_size(odd_mlp, 4)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        check_tensor_parallel_size(smollm, 0)


def test_hybrid_models_refuse_more_than_one_rank() -> None:
    hybrid = tiny_config("qwen3_5", vocab_size=320)
    check_tensor_parallel_size(hybrid, 1)
    with pytest.raises(ValueError, match="Gated DeltaNet.*tensor_parallel_size=1"):
        check_tensor_parallel_size(hybrid, 2)


def test_a_rank_shares_only_its_own_machine_between_the_ranks_there(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four ranks over two machines (Ray): each machine's cores and RAM are split two ways, not four.
    from dataclasses import replace

    from nanoengine.config import ParallelConfig
    from nanoengine.engine.arg_utils import EngineArgs
    from nanoengine.worker import worker as worker_module

    monkeypatch.setattr(worker_module, "available_ram_bytes", lambda: 8 << 30)
    config = replace(EngineArgs(model=tiny_llama).create_engine_config(), parallel_config=ParallelConfig(4, "ray"))
    per_machine = config.cache_config.cpu_kv_cache_fraction * (8 << 30)
    two_here = Worker(config, rank=3, local_rank=1, local_world_size=2)
    all_here = Worker(config, rank=3, local_rank=3)  # the one-machine default: every rank is here
    assert all_here.local_world_size == 4
    assert two_here._cpu_budget() == int(min(per_machine, config.cache_config.cpu_kv_cache_max_bytes)) // 2
    assert all_here._cpu_budget() == two_here._cpu_budget() // 2


def rank_and_world() -> tuple[int, int]:
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def test_a_rendezvous_port_taken_in_the_meantime_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first port drawn is held by another listener by the time rank 0 binds it: the run
    starts again on the next draw instead of failing (one rank, so each try costs one start)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        draws = iter([taken.getsockname()[1], tp_ranks.free_port()])
        monkeypatch.setattr(tp_ranks, "free_port", lambda: next(draws))
        assert run_on_ranks(rank_and_world, world_size=1) == [(0, 1)]
    assert next(draws, None) is None, "both ports were drawn"
