"""Token embedding and the LM head that turns hidden states back into logits.

Chapter 7 (the first and last step of the forward pass).
vLLM 0.32 counterpart: ``vllm/model_executor/layers/vocab_parallel_embedding.py``
(``VocabParallelEmbedding``, ``ParallelLMHead``) and
``vllm/model_executor/layers/logits_processor.py`` (``LogitsProcessor``).

Both layers hold a [vocab_size, hidden_size] matrix. Small models often *tie*
them (one matrix for both), which is why the LM head can adopt the embedding's
parameter instead of owning one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.model_executor.layers.cpu_linear import PackableLinear


class VocabEmbedding(nn.Module):
    """Row lookup: token id -> its hidden vector."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [num_tokens] int64 -> [num_tokens, hidden]
        return F.embedding(input_ids, self.weight)


class LMHead(PackableLinear):
    """hidden -> logits over the vocabulary, always returned in fp32."""

    bias = None  # an LM head has none; PackableLinear.matmul reads the attribute

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        # A tied head never allocates its own [vocab, hidden] matrix.
        self.weight = (
            tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))
        )

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's matrix: one parameter, loaded once, stored once."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [num_rows, hidden] -> [num_rows, vocab]. The matmul runs in the model dtype;
        # the sampler gets fp32 so softmax/top-p over a 150k vocabulary does not
        # suffer bf16's 8-bit mantissa.
        return self.matmul(hidden).float()
