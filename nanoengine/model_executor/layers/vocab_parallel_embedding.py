"""Token embedding and the LM head, their vocabulary split across tensor-parallel ranks.

Chapter 7 (the first and last step of the forward pass); chapter 6 (tensor
parallelism: the vocabulary split, and the logits every rank gathers).
vLLM 0.32 counterpart: ``vllm/model_executor/layers/vocab_parallel_embedding.py``
(``VocabParallelEmbedding``, ``ParallelLMHead``) and
``vllm/model_executor/layers/logits_processor.py`` (``LogitsProcessor``, which
gathers the logits).

Both layers hold a [vocab_size, hidden_size] matrix. Small models often *tie*
them (one matrix for both), which is why the LM head can adopt the embedding's
parameter instead of owning one.

With N ranks each holds a contiguous block of vocabulary rows
(``VocabShard``): ceil(vocab / N) of them, the last block padded with zero
rows when N does not divide the vocabulary. The embedding looks up only the
ids in its block and writes zeros for the others; an all-reduce then adds the
N results, of which exactly one is not zero per token. The LM head computes
the logits of its block; an all-gather lays the N blocks side by side, and
the padding columns are cut off, so every rank ends with the same full
[num_rows, vocab_size] fp32 logits and samples the same tokens. vLLM also
pads the vocabulary to a multiple of 64 at one rank; here one rank keeps the
checkpoint's matrix exactly, as before tensor parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from nanoengine.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from nanoengine.model_executor.layers.cpu_linear import PackableLinear
from nanoengine.model_executor.layers.linear import ShardId, check_shape, copy_weight
from nanoengine.model_executor.layers.quantization.base_config import QuantizeMethodBase
from nanoengine.utils.math_utils import cdiv


@dataclass(frozen=True)
class VocabShard:
    """Which rows of a [vocab_size, hidden] matrix rank ``tp_rank`` of ``tp_size`` holds."""

    vocab_size: int
    tp_size: int
    tp_rank: int

    @property
    def rows_per_rank(self) -> int:
        """Every rank allocates this many rows (the last may hold padding)."""
        return cdiv(self.vocab_size, self.tp_size)

    @property
    def start(self) -> int:
        """The first token id of this rank's block."""
        return self.tp_rank * self.rows_per_rank

    @property
    def end(self) -> int:
        """One past the last *real* token id of the block (padding excluded)."""
        return min(self.start + self.rows_per_rank, self.vocab_size)

    def load_rows(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: ShardId | None, owner: str
    ) -> None:
        """Copy this block of the checkpoint's [vocab_size, hidden] matrix; zero the padding.

        ``owner`` (the layer's class name) names the layer when a checkpoint
        tensor comes with a shard id: a vocabulary matrix has no shards.
        """
        if shard_id is not None:
            raise ValueError(f"{owner} has no shards; got shard {shard_id!r}.")
        check_shape(loaded_weight, (self.vocab_size, *param.shape[1:]), "The vocabulary matrix")
        real = self.end - self.start
        copy_weight(param.data.narrow(0, 0, real), loaded_weight.narrow(0, self.start, real), "vocabulary rows")
        # Padding rows are never looked up, and their logits are cut off; zeros
        # keep them harmless and deterministic anyway.
        param.data[real:].zero_()


def this_rank_vocab_shard(vocab_size: int) -> VocabShard:
    return VocabShard(vocab_size, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())


class VocabParallelEmbedding(nn.Module):
    """Row lookup: token id -> its hidden vector, from this rank's block of the vocabulary."""

    # Set for a quantized matrix (layers/quantization/): it looks up and dequantizes rows.
    quant_method: QuantizeMethodBase | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.shard = this_rank_vocab_shard(num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard.rows_per_rank, embedding_dim))

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        self.shard.load_rows(param, loaded_weight, shard_id, type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [num_tokens] int64 -> [num_tokens, hidden]
        if self.quant_method is not None:  # one rank only (quantization="gguf" refuses more)
            return self.quant_method.apply(self, input_ids)
        if self.shard.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        start, end = self.shard.start, self.shard.end
        mine = (input_ids >= start) & (input_ids < end)  # [num_tokens] bool
        # Another rank's ids look up row 0 here, then are zeroed: a lookup that
        # cannot go out of range, and a zero that adds nothing to the sum.
        rows = F.embedding(torch.where(mine, input_ids - start, 0), self.weight)
        rows = rows.masked_fill(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(rows)

    def extra_repr(self) -> str:
        split = f", rank {self.shard.tp_rank} holds ids [{self.shard.start}, {self.shard.end})"
        return f"{self.num_embeddings}, {self.weight.shape[1]}" + (split if self.shard.tp_size > 1 else "")


class ParallelLMHead(PackableLinear):
    """hidden -> logits over the whole vocabulary, always returned in fp32.

    Each rank multiplies by its block of the vocabulary matrix; the blocks are
    gathered, so every rank returns all ``num_embeddings`` logits.
    """

    bias = None  # an LM head has none; PackableLinear.matmul reads the attribute

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tied_to: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.shard = this_rank_vocab_shard(num_embeddings)
        # A tied head never allocates its own [vocab / N, hidden] matrix.
        self.weight = (
            tied_to.weight
            if tied_to is not None
            else nn.Parameter(torch.empty(self.shard.rows_per_rank, embedding_dim))
        )

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's matrix: one parameter, loaded once, stored once.

        Both split the same vocabulary over the same ranks, so the blocks agree.
        """
        self.weight = embedding.weight

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        self.shard.load_rows(param, loaded_weight, shard_id, type(self).__name__)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [num_rows, hidden] -> [num_rows, vocab]. The matmul runs in the model dtype;
        # the sampler gets fp32 so softmax/top-p over a 150k vocabulary does not
        # suffer bf16's 8-bit mantissa.
        logits = self.matmul(hidden)  # [num_rows, vocab / N] (this rank's block)
        if self.shard.tp_size > 1:
            # [num_rows, N * ceil(vocab / N)]: rank order is token-id order; cut the padding.
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[..., : self.num_embeddings]
        return logits.float()
