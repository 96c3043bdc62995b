"""Every tensor-parallel layer, and whole models, on two real ranks against one-process torch.

Two spawned processes join a gloo group (``chapters/grade_checks/tp_ranks.py``); each
builds its slice of every layer, loads it from the *whole* checkpoint-shaped
tensors through the layer's ``weight_loader``, and runs it. Here, in one
process, plain torch (``F.linear``, ``F.embedding``) on the whole tensors says
what each rank must hold and return. A whole tiny Llama/Qwen3, each rank
loading its shard of the checkpoint, must give the one-process model's
logits. And a one-process model must never touch ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_attention_ref import allocate_blocks, make_attn_metadata
from tiny_models import tiny_config, write_random_model
from transformers import AutoConfig

from chapters.grade_checks.tp_ranks import run_on_ranks
from nanoengine.attention.layer import Attention, bind_kv_cache
from nanoengine.distributed.parallel_state import get_tensor_model_parallel_rank
from nanoengine.model_executor.layers import linear, vocab_parallel_embedding
from nanoengine.model_executor.layers.cpu_linear import resolve_linear_backend
from nanoengine.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanoengine.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from nanoengine.model_executor.model_loader import get_model

TP = 2
HIDDEN, HEAD, TOKENS = 16, 4, 5
VOCAB = 11  # odd: rank 1 holds ids 6..10 and one padding row
IDS = [0, 5, 6, 10, 3, 7]  # both ranks' blocks, both block edges


def make_case() -> dict[str, torch.Tensor]:
    """Whole, checkpoint-shaped tensors for every layer, and their inputs."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "x": rand(TOKENS, HIDDEN),
        "col.w": rand(12, HIDDEN), "col.b": rand(12),
        "gate.w": rand(10, HIDDEN), "gate.b": rand(10), "up.w": rand(10, HIDDEN), "up.b": rand(10),
        "q.w": rand(4 * HEAD, HIDDEN), "q.b": rand(4 * HEAD),
        "k.w": rand(2 * HEAD, HIDDEN), "k.b": rand(2 * HEAD),
        "v.w": rand(2 * HEAD, HIDDEN), "v.b": rand(2 * HEAD),
        "k1.w": rand(HEAD, HIDDEN), "v1.w": rand(HEAD, HIDDEN),  # one KV head for four query heads
        "row.x": rand(TOKENS, 12), "row.w": rand(HIDDEN, 12), "row.b": rand(HIDDEN),
        "vocab.w": rand(VOCAB, HIDDEN), "ids": torch.tensor(IDS),
    }


# ---- what each rank runs ------------------------------------------------------


def _loaded(layer: torch.nn.Module, shards: dict[str, tuple[torch.Tensor, Any]]) -> Any:
    """``layer`` with each named parameter loaded through its weight_loader."""
    params = dict(layer.named_parameters())
    for name, (tensor, shard_id) in shards.items():
        layer.weight_loader(params[name], tensor, shard_id)
    return layer


def shard_every_layer(case: dict[str, torch.Tensor], backend: str) -> dict[str, Any]:
    """Rank side: every parallel layer's local weights and outputs (``backend``: the packed path)."""
    x = case["x"]
    rank = get_tensor_model_parallel_rank()
    out: dict[str, Any] = {"rank": rank}

    col = _loaded(ColumnParallelLinear(HIDDEN, 12, bias=True), {"weight": (case["col.w"], None),
                                                                 "bias": (case["col.b"], None)})
    out["col.weight"], out["col.out"] = col.weight.clone(), col(x)
    col.gather_output = True
    out["col.gathered"] = col(x)

    merged = MergedColumnParallelLinear(HIDDEN, [10, 10], bias=True)
    for shard_id, part in enumerate(("gate", "up")):
        merged.weight_loader(merged.weight, case[f"{part}.w"], shard_id)
        merged.weight_loader(merged.bias, case[f"{part}.b"], shard_id)
    out["merged.out"] = merged(x)

    qkv = QKVParallelLinear(HIDDEN, HEAD, total_num_heads=4, total_num_kv_heads=2, bias=True)
    for part in "qkv":
        qkv.weight_loader(qkv.weight, case[f"{part}.w"], part)
        qkv.weight_loader(qkv.bias, case[f"{part}.b"], part)
    out["qkv.out"] = qkv.split_qkv(qkv(x))
    replicated = QKVParallelLinear(HIDDEN, HEAD, total_num_heads=4, total_num_kv_heads=1)
    for part, key in zip("qkv", ("q.w", "k1.w", "v1.w")):
        replicated.weight_loader(replicated.weight, case[key], part)
    out["qkv1.out"] = replicated.split_qkv(replicated(x))
    out["qkv1.heads"] = (replicated.num_heads, replicated.num_kv_heads)

    mine = case["row.x"].chunk(TP, dim=-1)[rank]  # what a column-parallel layer leaves here
    for bias in (True, False):
        row = RowParallelLinear(12, HIDDEN, bias=bias)
        row.weight_loader(row.weight, case["row.w"])
        if row.bias is not None:
            row.weight_loader(row.bias, case["row.b"])
        out[f"row.out.{bias}"] = row(mine)
        row.reduce_results = False
        out[f"row.partial.{bias}"] = row(mine)
        row.reduce_results = True
        if backend != "torch":
            row.pack(backend)
        out[f"row.packed.{bias}"] = row(mine)

    embedding = VocabParallelEmbedding(VOCAB, HIDDEN)
    embedding.weight_loader(embedding.weight, case["vocab.w"])
    out["embed.weight"], out["embed.out"] = embedding.weight.clone(), embedding(case["ids"])
    head = ParallelLMHead(VOCAB, HIDDEN)
    head.weight_loader(head.weight, case["vocab.w"])
    tied = ParallelLMHead(VOCAB, HIDDEN, tied_to=embedding)
    out["head.logits"], out["tied.logits"] = head(x), tied(x)
    out["tied.shares"] = tied.weight is embedding.weight
    if backend != "torch":
        tied.pack(backend)
    out["tied.packed"] = tied(x)
    return out


@pytest.fixture(scope="module")
def case() -> dict[str, torch.Tensor]:
    return make_case()


@pytest.fixture(scope="module")
def packed_backend() -> str:
    """The CPU fast path here; resolved (and its kernels built, if need be) before any rank starts."""
    return resolve_linear_backend("auto", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def ranks(case: dict[str, torch.Tensor], packed_backend: str) -> list[dict[str, Any]]:
    return run_on_ranks(shard_every_layer, case, packed_backend, world_size=TP)


def rows(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block of rows of a whole tensor split in TP equal blocks."""
    return tensor.chunk(TP, dim=0)[rank]


# ---- the layers ---------------------------------------------------------------


def test_each_rank_ran_with_its_own_rank(ranks: list[dict[str, Any]]) -> None:
    assert [r["rank"] for r in ranks] == list(range(TP))


def test_column_parallel_holds_its_rows_and_gathers_all(case: dict, ranks: list[dict[str, Any]]) -> None:
    full = F.linear(case["x"], case["col.w"], case["col.b"])  # [T, 12]
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["col.weight"], rows(case["col.w"], rank))
        torch.testing.assert_close(got["col.out"], full.chunk(TP, dim=-1)[rank])
        torch.testing.assert_close(got["col.gathered"], full)


def test_merged_column_parallel_splits_each_projection(case: dict, ranks: list[dict[str, Any]]) -> None:
    gate = F.linear(case["x"], case["gate.w"], case["gate.b"])
    up = F.linear(case["x"], case["up.w"], case["up.b"])
    for rank, got in enumerate(ranks):
        # [gate rows of this rank | up rows of this rank], not a block of [gate | up]
        want = torch.cat([gate.chunk(TP, -1)[rank], up.chunk(TP, -1)[rank]], dim=-1)
        torch.testing.assert_close(got["merged.out"], want)


def test_qkv_parallel_splits_query_and_kv_heads(case: dict, ranks: list[dict[str, Any]]) -> None:
    q, k, v = (F.linear(case["x"], case[f"{p}.w"], case[f"{p}.b"]) for p in "qkv")
    for rank, got in enumerate(ranks):
        # 4 query heads, 2 KV heads: rank r holds query heads 2r, 2r+1 and KV head r.
        want = (q.chunk(TP, -1)[rank], k.chunk(TP, -1)[rank], v.chunk(TP, -1)[rank])
        for got_part, want_part in zip(got["qkv.out"], want):
            torch.testing.assert_close(got_part, want_part)


def test_qkv_parallel_replicates_a_lone_kv_head(case: dict, ranks: list[dict[str, Any]]) -> None:
    q = F.linear(case["x"], case["q.w"])
    k, v = F.linear(case["x"], case["k1.w"]), F.linear(case["x"], case["v1.w"])
    for rank, got in enumerate(ranks):
        assert got["qkv1.heads"] == (2, 1)
        got_q, got_k, got_v = got["qkv1.out"]
        torch.testing.assert_close(got_q, q.chunk(TP, -1)[rank])
        torch.testing.assert_close(got_k, k)  # KV head 0 on both ranks
        torch.testing.assert_close(got_v, v)


@pytest.mark.parametrize("bias", [True, False])
def test_row_parallel_sums_the_ranks(case: dict, ranks: list[dict[str, Any]], bias: bool) -> None:
    want = F.linear(case["row.x"], case["row.w"], case["row.b"] if bias else None)
    for got in ranks:
        torch.testing.assert_close(got[f"row.out.{bias}"], want)
        torch.testing.assert_close(got[f"row.packed.{bias}"], want, atol=1e-4, rtol=1e-5)
    # Unreduced, the shares add up to the product, the bias counted once.
    torch.testing.assert_close(sum(got[f"row.partial.{bias}"] for got in ranks), want)


def test_vocab_parallel_embedding_looks_up_ids_of_both_blocks(case: dict, ranks: list[dict[str, Any]]) -> None:
    weight = case["vocab.w"]
    padded = torch.cat([weight, torch.zeros(1, HIDDEN)])  # 11 ids -> 2 blocks of 6 rows
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["embed.weight"], rows(padded, rank))
        torch.testing.assert_close(got["embed.out"], F.embedding(case["ids"], weight))


def test_lm_head_gathers_full_fp32_logits_tied_or_not(case: dict, ranks: list[dict[str, Any]]) -> None:
    want = F.linear(case["x"], case["vocab.w"])  # [T, 11]
    for got in ranks:
        assert got["head.logits"].shape == (TOKENS, VOCAB) and got["head.logits"].dtype == torch.float32
        torch.testing.assert_close(got["head.logits"], want)
        torch.testing.assert_close(got["tied.logits"], want)
        torch.testing.assert_close(got["tied.packed"], want, atol=1e-4, rtol=1e-5)
        assert got["tied.shares"]


# ---- loaders, at one rank -------------------------------------------------------


def test_loaders_name_the_shape_and_the_shard(case: dict) -> None:
    qkv = QKVParallelLinear(HIDDEN, HEAD, total_num_heads=4, total_num_kv_heads=2)
    with pytest.raises(ValueError, match=r"The shard 'k' has shape \(4, 16\).*expects \(8, 16\)"):
        qkv.weight_loader(qkv.weight, case["k1.w"], "k")
    with pytest.raises(ValueError, match="Unknown shard 'z'"):
        qkv.weight_loader(qkv.weight, case["k.w"], "z")
    row = RowParallelLinear(12, HIDDEN)
    with pytest.raises(ValueError, match="has no shards"):
        row.weight_loader(row.weight, case["row.w"], 0)


# ---- whole models ---------------------------------------------------------------

BLOCK_SIZE, NUM_BLOCKS = 4, 24
PROMPTS = ([3, 17, 40, 41, 9], [100, 2, 7, 8, 250, 31, 4, 4], [60, 61, 62])
DECODE_TOKENS = ([11, 12], [13, 14], [15, 16])


def model_logits(model_dir: str, linear_backend: str) -> list[torch.Tensor]:
    """A prefill of three prompts and two decode steps; the logits of each step.

    Runs as it is in this process (one rank) and on every rank; the KV cache
    holds this rank's KV heads, as the Attention layers were built with them.
    """
    config = AutoConfig.from_pretrained(model_dir)
    model = get_model(model_dir, config, torch.float32, torch.device("cpu"), linear_backend)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, layers[0].num_kv_heads, layers[0].head_dim)
    bind_kv_cache(model, [torch.zeros(shape) for _ in layers])
    lengths = [len(p) for p in PROMPTS]
    blocks = allocate_blocks([n + 2 for n in lengths], BLOCK_SIZE, NUM_BLOCKS, seed=3)
    md = make_attn_metadata([0] * len(lengths), lengths, blocks, BLOCK_SIZE)
    positions = torch.cat([torch.arange(n) for n in lengths])
    steps = [model.compute_logits(model(torch.tensor([t for p in PROMPTS for t in p]), positions, md))]
    for step in range(2):
        computed = [n + step for n in lengths]
        md = make_attn_metadata(computed, [1] * len(lengths), blocks, BLOCK_SIZE)
        ids = torch.tensor([tokens[step] for tokens in DECODE_TOKENS])
        steps.append(model.compute_logits(model(ids, torch.tensor(computed), md)))
    return steps


def models_on_each_rank(dirs: list[str], backends: list[str]) -> list[list[torch.Tensor]]:
    return [model_logits(d, b) for d, b in zip(dirs, backends)]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Tiny Llama (tied), Qwen3 (untied, q/k norms) and a Llama with one KV head (replicated)."""
    one_kv_head = tiny_config("llama", vocab_size=320, tie=False)
    one_kv_head.num_key_value_heads = 1
    path = write_random_model(tmp_path_factory.mktemp("tiny-llama-1kv"), one_kv_head, seed=1)
    return [tiny_model_factory("llama"), tiny_model_factory("qwen3", tie=False), str(path)]


def test_two_rank_models_give_the_one_rank_logits(model_dirs: list[str], packed_backend: str) -> None:
    backends = ["torch", packed_backend, "torch"]
    want = [model_logits(d, b) for d, b in zip(model_dirs, backends)]
    per_rank = run_on_ranks(models_on_each_rank, model_dirs, backends, world_size=TP, timeout=240)
    for got in per_rank:
        for model_dir, backend, got_steps, want_steps in zip(model_dirs, backends, got, want):
            # Summation order differs (two partial sums, then the all-reduce):
            # fp32 rounding, far below any real difference. Packed GEMMs block
            # the (half-size) weights differently again: test_cpu_fast_paths' bound.
            tol = {"atol": 1e-5, "rtol": 1e-5} if backend == "torch" else {"atol": 1e-4, "rtol": 1e-5}
            for got_logits, want_logits in zip(got_steps, want_steps):
                torch.testing.assert_close(got_logits, want_logits, **tol, msg=lambda m, d=model_dir: f"{d}: {m}")


def test_one_rank_model_calls_no_torch_distributed(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At TP=1 nothing initializes a group or calls a collective, not even the identity ops."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a one-rank model called torch.distributed")

    for name in ("init_process_group", "new_group", "all_reduce", "all_gather", "barrier", "broadcast"):
        monkeypatch.setattr(torch.distributed, name, refuse)
    for module in (linear, vocab_parallel_embedding):
        for name in ("tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather"):
            monkeypatch.setattr(module, name, refuse)
    steps = model_logits(tiny_llama, "torch")
    vocab_size = AutoConfig.from_pretrained(tiny_llama).vocab_size
    assert steps[0].shape == (sum(len(p) for p in PROMPTS), vocab_size) and torch.isfinite(steps[-1]).all()
    assert not torch.distributed.is_initialized()
