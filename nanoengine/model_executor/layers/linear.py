"""Linear projections, including the fused ones vLLM models are written with.

Chapter 7. vLLM 0.32 counterpart: ``vllm/model_executor/layers/linear.py``
(``ReplicatedLinear``, ``RowParallelLinear``, ``MergedColumnParallelLinear``,
``QKVParallelLinear``).

Why fuse? A checkpoint stores ``q_proj``, ``k_proj`` and ``v_proj`` as three
matrices, but all three read the same input. Stacking them row-wise into one
``qkv_proj`` weight turns three matmuls into one bigger, more efficient one; the
output is then split back into q, k and v. ``gate_proj``/``up_proj`` become
``gate_up_proj`` the same way. The price is paid at load time: each checkpoint
tensor must be copied into its *shard* (row range) of the fused weight, which is
what ``MergedColumnLinear.load_shard`` does.

nanoengine has no tensor parallelism, so vLLM's column/row-parallel classes
collapse into one plain ``Linear``; only the shard bookkeeping survives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nanoengine.model_executor.layers.cpu_linear import PackableLinear

# A shard is named by its position ("gate"=0, "up"=1) or by a letter ("q", "k", "v").
ShardId = int | str


def copy_weight(param: torch.Tensor, loaded_weight: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (casting its dtype), checking shapes."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"Weight '{name}' has shape {tuple(loaded_weight.shape)} in the checkpoint "
            f"but the model expects {tuple(param.shape)}."
        )
    # .data: loading is not part of any autograd graph. copy_ also casts, which is
    # where a bf16 checkpoint becomes an fp32 model (or the reverse).
    param.data.copy_(loaded_weight)


class Linear(PackableLinear):
    """``y = x @ W^T + b`` with ``W`` of shape [output_size, input_size].

    ``matmul`` is ``F.linear`` until ``process_weights_after_loading`` switches
    the layer to a prepacked weight (CPU only, see ``cpu_linear.py``).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # torch.empty: every value is overwritten by the checkpoint, so random
        # initialisation would be wasted time (seconds for a real model).
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, input_size] -> [num_tokens, output_size]
        return self.matmul(x)

    def extra_repr(self) -> str:
        packed = f", {self.backend}" if self.packed else ""
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}{packed}"


class MergedColumnLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    ``output_sizes[i]`` rows belong to shard ``shard_ids[i]``; the forward pass
    returns them concatenated, in that order, along the last dimension.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        shard_ids: Sequence[ShardId] | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        ids = list(shard_ids) if shard_ids is not None else list(range(len(output_sizes)))
        if len(ids) != len(self.output_sizes):
            raise ValueError(f"shard_ids {ids} must name each of the {len(self.output_sizes)} output slices.")
        # shard id -> (first row, number of rows) inside the fused weight
        self.shard_ranges: dict[ShardId, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in zip(ids, self.output_sizes):
            self.shard_ranges[shard_id] = (offset, size)
            offset += size

    def load_shard(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: ShardId) -> None:
        """Copy one checkpoint projection into its row range of ``weight`` or ``bias``."""
        if shard_id not in self.shard_ranges:
            raise ValueError(f"Unknown shard {shard_id!r}; this layer has {list(self.shard_ranges)}.")
        offset, size = self.shard_ranges[shard_id]
        # Rows are dim 0 for both the weight [out, in] and the bias [out].
        copy_weight(param.data.narrow(0, offset, size), loaded_weight, f"shard {shard_id!r}")


class QKVLinear(MergedColumnLinear):
    """q, k and v projections fused; k and v are narrower when GQA shares KV heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(
            hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, shard_ids=("q", "k", "v")
        )

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[num_tokens, q + 2 * kv] -> q [num_tokens, q_size], k and v [num_tokens, kv_size]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
