"""The grader's checks for exercise 6.2 (chapter 6, tensor parallelism).

6.2 is ``QKVParallelLinear.weight_loader``: rank r's heads of one whole
checkpoint projection, copied into its place in the fused [q | k | v] weight.
The unit checks build the layer as rank r of N would, in this one process:
a stand-in tensor-parallel group says "rank r of N" to every caller of
``get_tensor_model_parallel_rank``/``_world_size`` while the layer is built
and loaded (a loader calls no collective, so no process group is needed).
The layer is small (8 query heads of 2 rows, hidden size 8), and every row
of every checkpoint tensor says where it came from: row i of ``k_proj`` holds
2000 + i (plus column / 100), so the fused weight reads back as a list of
heads, ``["q4", "q5", "q6", "q7", "k1", "v1"]``, and rows nobody wrote hold
-1 and read as ``"-"``.

The end-to-end checks run the real model code. Two spawned ranks
(``tp_ranks.py``, gloo) each put the weight loader being graded in place
before they build the grader's tiny Llamas, so each rank loads its slices
through it; their logits must be Hugging Face's for the same checkpoint.
A greedy generation through ``LLM`` at one rank comes last.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from chapters.grade_checks.common import PROMPTS, Check, e2e_plain
from chapters.grade_checks.tiny_model import no_progress_bars, tiny_llama_model_dir
from chapters.grade_checks.tp_ranks import ShippedFunction, run_on_ranks
from chapters.grade_messages import describe_exception
from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.attention.layer import Attention, bind_kv_cache
from nanoengine.distributed import parallel_state
from nanoengine.model_executor.layers.linear import QKVParallelLinear
from nanoengine.model_executor.model_loader import get_model

HIDDEN = 8
HEAD_SIZE = 2
NUM_HEADS = 8
# Row i of projection p holds CODES[p] + i + column / 100: every row says where it came from.
CODES = {"q": 1000, "k": 2000, "v": 3000}
UNTOUCHED = -1.0  # what the fused parameter holds before any load


# ------------------------------------------------------ a layer as rank r of N
@contextmanager
def as_rank(rank: int, tp_size: int) -> Iterator[None]:
    """Inside, ``get_tensor_model_parallel_rank()`` is ``rank`` and the world size ``tp_size``."""
    saved = parallel_state._TP
    # A group with no process group behind it: building and loading a layer only
    # asks for the rank and the size; a collective would fail loudly.
    parallel_state._TP = parallel_state.GroupCoordinator(
        list(range(tp_size)), rank, cast(dist.ProcessGroup, None), rank)
    try:
        yield
    finally:
        parallel_state._TP = saved


def checkpoint(num_heads: int, num_kv_heads: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Whole ``q_proj``/``k_proj``/``v_proj`` tensors, (weight [heads * 2, 8], bias [heads * 2]) each."""
    tensors = {}
    for part, heads in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
        rows = torch.arange(heads * HEAD_SIZE, dtype=torch.float32)[:, None] + CODES[part]
        weight = rows + torch.arange(HIDDEN, dtype=torch.float32)[None, :] / 100
        tensors[part] = (weight, rows[:, 0].clone())
    return tensors


@dataclass(frozen=True)
class Setup:
    """Rank ``rank`` of ``tp_size`` on a layer of 8 query heads and ``num_kv_heads`` KV heads."""

    rank: int
    tp_size: int
    num_kv_heads: int

    def __str__(self) -> str:
        replicas = self.tp_size // self.num_kv_heads
        kv = f"{self.num_kv_heads} KV heads" + (f", each on {replicas} ranks" if replicas > 1 else "")
        return f"rank {self.rank} of {self.tp_size} ({NUM_HEADS} query heads, {kv})"

    @contextmanager
    def layer(self, into: str = "weight") -> Iterator[tuple[QKVParallelLinear, nn.Parameter]]:
        """This rank's layer and its fused ``weight`` (or ``bias``), filled with UNTOUCHED, while it is rank r of N."""
        with as_rank(self.rank, self.tp_size):
            layer = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, self.num_kv_heads, bias=True)
            param = layer.weight if into == "weight" else layer.bias
            assert param is not None, "the layer was built with a bias"
            param.data.fill_(UNTOUCHED)
            yield layer, param

    def loaded(self, parts: str, into: str = "weight") -> torch.Tensor:
        """The fused ``weight`` (or ``bias``) after loading the whole projections ``parts`` ("qkv"), in order."""
        whole = checkpoint(NUM_HEADS, self.num_kv_heads)
        with self.layer(into) as (layer, param):
            for part in parts:
                layer.weight_loader(param, whole[part][0 if into == "weight" else 1], part)
        return param.data


def setups(tp_sizes: tuple[int, ...], num_kv_heads: int) -> list[Setup]:
    return [Setup(rank, tp, num_kv_heads) for tp in tp_sizes for rank in range(tp)]


# -------------------------------------------- reading a fused parameter back
def row_label(row: torch.Tensor) -> str | tuple[str, int]:
    """(projection, its row) when ``row`` is a whole checkpoint row; "-" untouched; "?" else."""
    if bool((row == UNTOUCHED).all()):
        return "-"
    first = float(row.reshape(-1)[0])
    for part, code in CODES.items():
        index = round(first - code)
        if 0 <= index < 1000:
            expected = index + code + torch.arange(row.numel(), dtype=torch.float32) / 100
            return (part, index) if torch.equal(row.reshape(-1), expected) else "?"
    return "?"


def heads(fused: torch.Tensor) -> list[str]:
    """The fused parameter by head (2 rows each): "q5" is head 5 of q_proj, whole and in order."""
    labels = []
    for start in range(0, fused.shape[0], HEAD_SIZE):
        rows = [row_label(row) for row in fused[start : start + HEAD_SIZE]]
        first = rows[0]
        if isinstance(first, tuple) and first[1] % HEAD_SIZE == 0 and rows == [
                (first[0], first[1] + j) for j in range(HEAD_SIZE)]:
            labels.append(f"{first[0]}{first[1] // HEAD_SIZE}")
        elif all(row == "-" for row in rows):
            labels.append("-")
        else:  # not one whole head: say what each row is
            labels.append("(" + " ".join(r if isinstance(r, str) else f"{r[0]} row {r[1]}" for r in rows) + ")")
    return labels


def projections(fused: torch.Tensor) -> str:
    """One letter a head's worth of rows: which projection they came from ("qqqqkv"), whatever head."""
    letters = []
    for start in range(0, fused.shape[0], HEAD_SIZE):
        found = {label if isinstance(label, str) else label[0]
                 for label in map(row_label, fused[start : start + HEAD_SIZE])}
        letters.append(found.pop() if len(found) == 1 else "?")
    return "".join(letters)


def read_back(setup: Setup, parts: str, into: str, reader: Callable[[torch.Tensor], Any]) -> Any:
    """``reader`` of the fused parameter after the loads; or, when a load raises, which
    exception and where, so the label still says which rank and which loads."""
    try:
        return reader(setup.loaded(parts, into))
    except NotImplementedError:  # an unwritten loader: say so, as every other exercise does
        raise
    except Exception as exc:  # noqa: BLE001 -- any other failure is this rank's answer
        return "; ".join(line.strip() for line in describe_exception(exc, None).splitlines())


def heads_after_loading(cases: list[Setup], parts: str = "qkv", into: str = "weight") -> dict[str, Any]:
    return {f"{setup}, {_loads(parts)}: fused {into} by head": read_back(setup, parts, into, heads)
            for setup in cases}


def _loads(parts: str) -> str:
    return " then ".join(f"{part}_proj" for part in parts)


# ------------------------------------------------------ 6.2 the unit checks
def q_heads_split(model: str) -> dict[str, Any]:
    """Only ``q_proj`` (8 heads of 2 rows, hidden size 8) loaded, on every rank of
    2, 4 and 8; the fused weight read back by head.
    """
    return heads_after_loading(setups((2, 4, 8), num_kv_heads=2), parts="q")


def shards_at_their_offsets(model: str) -> dict[str, Any]:
    """Ranks of 1 and 2 with 2 KV heads, rank 1 of 2 with 4: ``q_proj``, ``k_proj``
    and ``v_proj`` loaded alone, then all three (q, k, v and v, k, q); each head's
    worth of rows shown by the projection it came from.
    """
    cases = [Setup(0, 1, 2), Setup(0, 2, 2), Setup(1, 2, 2), Setup(1, 2, 4)]
    return {f"{setup}, {_loads(parts)}: fused weight by projection": read_back(setup, parts, "weight", projections)
            for setup in cases for parts in ("q", "k", "v", "qkv", "vkq")}


def one_rank_takes_all(model: str) -> dict[str, Any]:
    """One rank (tensor-parallel size 1) with 8, 2 and 1 KV heads: q, k and v loaded."""
    return heads_after_loading([Setup(0, 1, kv) for kv in (8, 2, 1)])


def kv_heads_split(model: str) -> dict[str, Any]:
    """2 KV heads over 2 ranks, 4 over 2 and 4 ranks, 8 over 4 ranks: q, k and v loaded on every rank."""
    return heads_after_loading(setups((2,), 2) + setups((2, 4), 4) + setups((4,), 8))


def kv_heads_replicated(model: str) -> dict[str, Any]:
    """Fewer KV heads than ranks: 2 over 4 and 8 ranks, 1 over 2 and 4: q, k and
    v loaded on every rank.
    """
    return heads_after_loading(setups((4, 8), 2) + setups((2, 4), 1))


def bias_split_the_same_way(model: str) -> dict[str, Any]:
    """The biases of q, k and v (row i of ``k_proj``'s bias holds 2000 + i) on one
    rank, on 2 ranks (2 KV heads, split) and on 4 (2 KV heads, replicated).
    """
    return heads_after_loading(setups((1, 2, 4), 2), into="bias")


def refusal(setup: Setup, into: str, tensor: torch.Tensor, shard_id: Any) -> dict[str, Any]:
    """Loading ``tensor`` with ``shard_id``: what was raised, its message, and whether anything was written."""
    with setup.layer(into) as (layer, param):
        raised, message = "nothing", ""
        try:
            layer.weight_loader(param, tensor, shard_id)
        except NotImplementedError:  # an unwritten loader: say so, do not grade its exception
            raise
        except Exception as exc:  # noqa: BLE001 -- which exception comes out is part of the answer
            raised, message = type(exc).__name__, str(exc)
        untouched = bool((param.data == UNTOUCHED).all())
    return {"raised": raised, "message": message, f"the fused {into} is left as it was": untouched}


def _names(message: str, shape: tuple[int, ...]) -> bool:
    """Whether ``message`` shows ``shape`` as a tuple, ``(4, 8)``, or a list/torch.Size, ``[4, 8]``."""
    return str(shape) in message or str(list(shape)) in message


def wrong_shapes_refused(model: str) -> dict[str, Any]:
    """A ``k_proj`` of ``q_proj``'s shape (16, 8) where (4, 8) belongs, ``q_proj``
    transposed (8, 16), a ``v_proj`` of hidden size 7, a ``q_proj`` bias of 15
    rows, and ``q_proj``'s bias given for the weight, on ranks of 1 and 2 with
    2 KV heads.
    """
    whole = checkpoint(NUM_HEADS, 2)
    q, v = whole["q"], whole["v"]
    cases = [  # (setup, param, shard id, tensor, the checkpoint's shape, what the tensor is)
        (Setup(0, 2, 2), "weight", "k", q[0], (4, 8), "q_proj's weight given as k"),
        (Setup(1, 2, 2), "weight", "q", q[0].T.contiguous(), (16, 8), "q_proj's weight transposed"),
        (Setup(0, 1, 2), "weight", "v", v[0][:, :7], (4, 8), "v_proj's weight with 7 columns"),
        (Setup(1, 2, 2), "bias", "q", q[1][:15], (16,), "q_proj's bias with 15 rows"),
        (Setup(0, 2, 2), "weight", "q", q[1], (16, 8), "q_proj's bias given for the weight"),
    ]
    result: dict[str, Any] = {}
    for setup, into, shard_id, tensor, expected, what in cases:
        shape = tuple(tensor.shape)
        outcome = refusal(setup, into, tensor, shard_id)
        message = outcome.pop("message")
        result[f"{setup}: {what}, {shape} where the checkpoint's is {expected}"] = {
            **outcome,
            "the message names the tensor's shape": _names(message, shape),
            "the message names the checkpoint's shape": _names(message, expected),
        }
    return result


def unknown_shard_refused(model: str) -> dict[str, Any]:
    """``k_proj``'s whole weight (the shape k and v take) loaded with shard ids "o"
    (o_proj's name), 0 (gate_up_proj's first shard) and None, rank 0 of 2, 2 KV heads.
    """
    k_weight = checkpoint(NUM_HEADS, 2)["k"][0]
    result: dict[str, Any] = {}
    for shard_id in ("o", 0, None):
        outcome = refusal(Setup(0, 2, 2), "weight", k_weight, shard_id)
        del outcome["message"]
        result[f"weight_loader(weight, k_proj's weight, shard_id={shard_id!r})"] = outcome
    return result


# ---------------------------------------------------- 6.2 end to end, two ranks
def prefill_metadata(lengths: list[int], block_size: int) -> AttentionMetadata:
    """One step that prefills whole prompts of ``lengths`` tokens; request i's
    blocks follow request i - 1's (no prefix cache, nothing computed before)."""
    starts, slots, tables, next_block = [0], [], [], 0
    for length in lengths:
        num_blocks = -(-length // block_size)
        tables.append(list(range(next_block, next_block + num_blocks)))
        slots += [next_block * block_size + position for position in range(length)]
        next_block += num_blocks
        starts.append(starts[-1] + length)
    width = max(len(table) for table in tables)
    block_table = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=starts[-1], num_reqs=len(lengths), num_decodes=0,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts, seq_lens_cpu=list(lengths),
    )


def rank_logits(loader: ShippedFunction, model_dirs: list[str]) -> list[torch.Tensor]:
    """On each rank: the loader put in place, then each model built (this rank's
    slices, loaded through it) and run on PROMPTS in one prefill step.
    Returns [sum of prompt lengths, vocab] logits per model."""
    QKVParallelLinear.weight_loader = loader.rebuild()  # type: ignore[method-assign]
    block_size, lengths = 4, [len(prompt) for prompt in PROMPTS]
    found = []
    for model_dir in model_dirs:
        model = get_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, torch.device("cpu"))
        assert isinstance(model, nn.Module), "every model is an nn.Module"
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        num_blocks = sum(-(-n // block_size) for n in lengths)
        # K and V of this rank's KV heads: [2, blocks, block_size, kv heads, head_dim] per layer.
        shape = (2, num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
        bind_kv_cache(model, [torch.zeros(shape) for _ in layers])
        token_ids = torch.tensor([token for prompt in PROMPTS for token in prompt])
        positions = torch.cat([torch.arange(n) for n in lengths])
        hidden = model(token_ids, positions, prefill_metadata(lengths, block_size))
        found.append(model.compute_logits(hidden))
    return found


@functools.cache
def hf_logits(model_dir: str) -> torch.Tensor:
    """Hugging Face transformers' own model on each prompt: [sum of prompt lengths, vocab]."""
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(torch.tensor([prompt])).logits[0] for prompt in PROMPTS])


TINY_LLAMAS = {2: "the tiny Llama, 4 query heads over 2 KV heads (one a rank)",
               1: "the tiny Llama, 4 query heads over 1 KV head (on both ranks)"}
# fp32, with the two ranks' partial sums added in another order than one
# matmul's: far below what a wrong head or a misplaced shard changes.
LOGITS_TOLERANCE = 1e-3


def e2e_two_ranks_match_hf(model: str) -> dict[str, Any]:
    """The grader's two tiny Llamas (4 query heads of 16; 2 KV heads, then 1), whatever
    model the grader is given, on 2 gloo ranks: each rank loads its slices through
    your loader and prefills four 7-token prompts; its logits against Hugging Face's.
    """
    dirs = {kv: tiny_llama_model_dir(kv) for kv in TINY_LLAMAS}
    loader = ShippedFunction.of(vars(QKVParallelLinear)["weight_loader"])
    per_rank = run_on_ranks(rank_logits, loader, list(dirs.values()), world_size=2, timeout=300)
    result: dict[str, Any] = {}
    for rank, logits in enumerate(per_rank):
        for (kv, model_dir), got in zip(dirs.items(), logits, strict=True):
            want = hf_logits(model_dir)
            label = f"{TINY_LLAMAS[kv]}, rank {rank} of 2"
            result[f"{label}: logits within {LOGITS_TOLERANCE} of Hugging Face's"] = bool(
                (got - want).abs().max() <= LOGITS_TOLERANCE)
            next_tokens = got.argmax(dim=-1).split([len(prompt) for prompt in PROMPTS])
            result[f"{label}: greedy next token after each position, prompt by prompt"] = [
                tokens.tolist() for tokens in next_tokens]
    return result


def e2e_one_rank_generation(model: str) -> dict[str, Any]:
    """``LLM`` at tensor-parallel size 1 on the model the grader is given (your loader
    loads every head): four 7-token prompts, 8 greedy tokens each, 64 blocks of 4 tokens.
    """
    return e2e_plain(model)


CHECKS: dict[str, tuple[Check, ...]] = {
    "6.2": (
        Check("q: rank r takes query heads [r * num_heads, (r + 1) * num_heads), whole rows", q_heads_split),
        Check("[q | k | v]: q at row 0, k after this rank's q rows, v after its k rows, nothing else written",
              shards_at_their_offsets),
        Check("one rank: every head of q, k and v", one_rank_takes_all),
        Check("k and v split like q when there are at least as many KV heads as ranks", kv_heads_split),
        Check("fewer KV heads than ranks: rank r takes KV head r * total_num_kv_heads // tp_size",
              kv_heads_replicated),
        Check("the bias is split and placed like the weight", bias_split_the_same_way),
        Check("a tensor of the wrong shape: ValueError naming both shapes, nothing copied", wrong_shapes_refused),
        Check("an unknown shard id: ValueError, nothing copied", unknown_shard_refused),
        Check("end to end: two ranks of a tiny Llama give Hugging Face's logits", e2e_two_ranks_match_hf,
              own_model="the grader's two tiny Llamas"),
        Check("end to end: greedy tokens through LLM at one rank", e2e_one_rank_generation),
    ),
}
