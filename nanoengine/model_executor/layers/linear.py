"""Linear projections split across tensor-parallel ranks, fused the way vLLM models are written.

Chapter 7 (the fused projections of the forward pass); chapter 6 (tensor
parallelism: which slice of each matrix a rank holds, and where ranks talk).
vLLM 0.32 counterpart: ``vllm/model_executor/layers/linear.py``
(``LinearBase``, ``ColumnParallelLinear``, ``MergedColumnParallelLinear``,
``QKVParallelLinear``, ``RowParallelLinear``).

Why fuse? A checkpoint stores ``q_proj``, ``k_proj`` and ``v_proj`` as three
matrices, but all three read the same input. Stacking them row-wise into one
``qkv_proj`` weight turns three matmuls into one bigger, more efficient one; the
output is then split back into q, k and v. ``gate_proj``/``up_proj`` become
``gate_up_proj`` the same way. The price is paid at load time: each checkpoint
tensor must be copied into its *shard* (row range) of the fused weight, which is
what ``MergedColumnParallelLinear.weight_loader`` does.

Why split? Tensor parallelism (Megatron-LM's scheme) spreads every weight
``W`` [out, in] over N ranks in one of two ways:

* **column-parallel**: rank r holds out/N rows of ``W`` and computes those
  out/N outputs from the whole input. No communication: each rank simply owns
  part of the output (whole attention heads, part of the MLP's hidden units).
* **row-parallel**: rank r holds in/N columns and reads only its in/N slice of
  the input -- exactly the slice the column-parallel layer before it produced.
  Each rank then has a *partial sum* of every output; an all-reduce adds them.

A decoder layer pairs them twice: ``qkv_proj`` (column) -> attention over this
rank's heads -> ``o_proj`` (row, all-reduce), and ``gate_up_proj`` (column) ->
activation -> ``down_proj`` (row, all-reduce): two all-reduces of
[num_tokens, hidden] per layer, and everything between them stays local.

Each layer reads the TP world size and its rank when it is built
(``parallel_state``), allocates only its slice, and gets a ``weight_loader``
that takes the *whole* checkpoint tensor and copies this rank's slice of it.
At world size 1 the slice is the whole matrix and ``forward`` is a single
matmul with its bias, as before tensor parallelism existed: no collective is
called. Every layer keeps the CPU prepacked path (``cpu_linear.py``), which
packs whatever slice the rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nanoengine.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from nanoengine.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from nanoengine.distributed.utils import divide, first_kv_head_of_rank, kv_heads_per_rank
from nanoengine.model_executor.layers.cpu_linear import PackableLinear

# A shard is named by its position ("gate"=0, "up"=1) or by a letter ("q", "k", "v").
ShardId = int | str


def copy_weight(param: torch.Tensor, loaded_weight: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (casting its dtype), checking shapes."""
    check_shape(loaded_weight, tuple(param.shape), f"Weight '{name}'")
    # .data: loading is not part of any autograd graph. copy_ also casts, which is
    # where a bf16 checkpoint becomes an fp32 model (or the reverse).
    param.data.copy_(loaded_weight)


def check_shape(loaded_weight: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    """ValueError (``what`` has shape ...) unless the checkpoint tensor has the shape the model expects."""
    if tuple(loaded_weight.shape) != expected:
        raise ValueError(
            f"{what} has shape {tuple(loaded_weight.shape)} in the checkpoint "
            f"but the model expects {expected}."
        )


class LinearBase(PackableLinear):
    """``y = x @ W^T + b`` over this rank's slice ``W`` [out_per_rank, in_per_rank].

    ``input_size``/``output_size`` are the whole layer's sizes (the checkpoint's);
    the ``*_per_partition`` sizes are what this rank allocates. ``matmul`` is
    ``F.linear`` until ``process_weights_after_loading`` switches the layer to a
    prepacked weight (CPU only, see ``cpu_linear.py``).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        input_size_per_partition: int,
        output_size_per_partition: int,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        # torch.empty: every value is overwritten by the checkpoint, so random
        # initialisation would be wasted time (seconds for a real model).
        self.weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition))
        self.bias = nn.Parameter(torch.empty(output_size_per_partition)) if bias else None

    def extra_repr(self) -> str:
        packed = f", {self.backend}" if self.packed else ""
        if self.quant_method is not None:
            packed = f", {self.quant_method}"
        split = ""
        if self.tp_size > 1:
            split = (
                f", rank {self.tp_rank}/{self.tp_size} holds "
                f"[{self.output_size_per_partition}, {self.input_size_per_partition}]"
            )
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}{split}{packed}"


class ColumnParallelLinear(LinearBase):
    """Output rows split across ranks: rank r computes outputs [r * out/N, (r + 1) * out/N).

    ``gather_output=True`` all-gathers the slices so every rank returns all
    ``output_size`` outputs; the models leave it off, because the next layer
    (row-parallel) wants exactly this rank's slice.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        rows = divide(output_size, tp_size, "output size of a column-parallel layer")
        super().__init__(input_size, output_size, bias, input_size, rows)
        self.gather_output = gather_output

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        """Copy this rank's rows of the checkpoint's [output_size, input_size] weight (or bias)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards; got shard {shard_id!r}.")
        rows = self.output_size_per_partition
        # Rows are dim 0 for both the weight [out, in] and the bias [out].
        check_shape(loaded_weight, (self.output_size, *param.shape[1:]), "The column-parallel weight")
        copy_weight(param, loaded_weight.narrow(0, self.tp_rank * rows, rows), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, input_size] -> [num_tokens, output_size / N]
        out = self.matmul(x)
        if self.gather_output and self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out, dim=-1)  # [num_tokens, output_size]
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input stacked along the output dimension.

    Each projection ``output_sizes[i]`` (named ``shard_ids[i]``) is split across
    ranks on its own, so rank r holds its slice of *each*: for gate/up of
    intermediate I at N ranks, the local weight is [gate rows of r; up rows of r]
    with I/N rows each, and the forward pass returns those two slices
    concatenated, gate first.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        shard_ids: Sequence[ShardId] | None = None,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        local_sizes = [divide(size, tp_size, "output size of a merged projection") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        ids = list(shard_ids) if shard_ids is not None else list(range(len(output_sizes)))
        if len(ids) != len(self.output_sizes):
            raise ValueError(f"shard_ids {ids} must name each of the {len(self.output_sizes)} output slices.")
        # shard id -> (first row, number of rows) inside this rank's fused weight
        self.shard_ranges: dict[ShardId, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in zip(ids, local_sizes):
            self.shard_ranges[shard_id] = (offset, size)
            offset += size

    def checkpoint_rows(self, shard_id: ShardId) -> tuple[int, int]:
        """(first row of this rank's slice in the checkpoint tensor of ``shard_id``,
        the rows that tensor has in all)."""
        _, size = self.shard_ranges[shard_id]
        return self.tp_rank * size, self.output_sizes[list(self.shard_ranges).index(shard_id)]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        """Copy this rank's rows of one checkpoint projection into its range of ``weight`` or ``bias``."""
        if shard_id is None or shard_id not in self.shard_ranges:
            raise ValueError(f"Unknown shard {shard_id!r}; this layer has {list(self.shard_ranges)}.")
        offset, size = self.shard_ranges[shard_id]
        first, total = self.checkpoint_rows(shard_id)
        name = f"shard {shard_id!r}"
        check_shape(loaded_weight, (total, *param.shape[1:]), f"The {name}")
        copy_weight(param.data.narrow(0, offset, size), loaded_weight.narrow(0, first, size), name)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused, split by attention head.

    Rank r holds ``total_num_heads / N`` query heads. KV heads (fewer with GQA)
    are split the same way when there are at least N of them; with fewer, each
    rank holds one KV head, ``r * total_num_kv_heads // N``, replicated on the
    ranks whose query heads read it (``distributed/utils.py``). ``num_heads``,
    ``num_kv_heads``, ``q_size`` and ``kv_size`` are this rank's.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp_size)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # As if every rank's slice were distinct (vLLM's convention): with
        # replicated KV heads the k/v "totals" exceed the checkpoint's, and
        # weight_loader says which checkpoint rows each rank really copies.
        sizes = [self.q_size * tp_size, self.kv_size * tp_size, self.kv_size * tp_size]
        super().__init__(hidden_size, sizes, bias, shard_ids=("q", "k", "v"))

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        """Copy this rank's heads of one whole checkpoint projection into the fused parameter.

        ``shard_id`` "q", "k" or "v" says which projection ``loaded_weight`` is:
        the checkpoint's whole ``q_proj``, ``k_proj`` or ``v_proj`` weight
        [heads * head_size, hidden_size], or its bias [heads * head_size].
        ``param`` is this rank's fused ``weight`` [q_size + 2 * kv_size,
        hidden_size] or ``bias`` [q_size + 2 * kv_size], laid out [q | k | v].

        Rank ``self.tp_rank`` of ``self.tp_size`` takes the ``num_heads`` query
        heads from ``tp_rank * num_heads`` on, and the ``num_kv_heads`` KV heads
        from ``tp_rank * total_num_kv_heads // tp_size`` on: an equal share of
        them, or, with fewer KV heads than ranks, the one head its query heads
        read (replicated on several ranks). A tensor whose shape is not the
        whole projection's is refused with a ValueError naming both shapes,
        before anything is copied; so is an unknown ``shard_id``.
        """
        if shard_id == "q":
            first_head, total_heads = self.tp_rank * self.num_heads, self.total_num_heads
            offset, rows = 0, self.q_size
        elif shard_id in ("k", "v"):
            first_head = first_kv_head_of_rank(self.total_num_kv_heads, self.tp_size, self.tp_rank)
            total_heads = self.total_num_kv_heads
            # [q | k | v]: k right after this rank's q rows, v right after its k rows.
            offset, rows = self.q_size + (self.kv_size if shard_id == "v" else 0), self.kv_size
        else:
            raise ValueError(f"Unknown shard {shard_id!r}; this layer has {list(self.shard_ranges)}.")
        # Heads are rows, dim 0 of both the weight [rows, hidden] and the bias [rows].
        check_shape(loaded_weight, (total_heads * self.head_size, *param.shape[1:]), f"The shard {shard_id!r}")
        mine = loaded_weight.narrow(0, first_head * self.head_size, rows)
        copy_weight(param.data.narrow(0, offset, rows), mine, f"shard {shard_id!r}")

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[num_tokens, q + 2 * kv] -> q [num_tokens, q_size], k and v [num_tokens, kv_size]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(LinearBase):
    """Input columns split across ranks; the partial outputs are summed over ranks.

    Rank r holds ``W[:, r * in/N : (r + 1) * in/N]`` and reads the matching
    slice of the input (what a column-parallel layer left on this rank), so
    ``x_r @ W_r^T`` is this rank's share of the full product. The all-reduce
    adds the N shares; the bias, held whole by every rank, is added once after
    it. ``reduce_results=False`` returns the shares unsummed for a caller that
    reduces later; rank 0's share then carries the bias, so the sum still
    counts it once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        columns = divide(input_size, tp_size, "input size of a row-parallel layer")
        super().__init__(input_size, output_size, bias, columns, output_size)
        self.reduce_results = reduce_results

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        """Copy this rank's columns of the checkpoint weight; the bias whole."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards; got shard {shard_id!r}.")
        if param is self.bias:
            copy_weight(param, loaded_weight, "row-parallel bias")
            return
        if self.quant_method is not None:  # GGUF blocks, on one rank: the whole matrix
            copy_weight(param, loaded_weight, "row-parallel weight")
            return
        columns = self.input_size_per_partition
        check_shape(loaded_weight, (self.output_size, self.input_size), "The row-parallel weight")
        copy_weight(param, loaded_weight.narrow(1, self.tp_rank * columns, columns), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, input_size / N] -> [num_tokens, output_size]
        if self.tp_size == 1:
            return self.matmul(x)  # the whole matrix: one matmul, bias included
        partial = self.matmul(x, add_bias=False)
        if not self.reduce_results:
            return partial + self.bias if self.bias is not None and self.tp_rank == 0 else partial
        out = tensor_model_parallel_all_reduce(partial)
        return out + self.bias if self.bias is not None else out
