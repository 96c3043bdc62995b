"""The arithmetic of splitting a model across tensor-parallel ranks, and the check that it splits.

Chapter 6 (tensor parallelism: which sizes a rank holds, and which models can be split).
vLLM 0.32 counterpart: ``divide``/``ensure_divisibility`` in
``vllm/distributed/utils.py``, the head arithmetic of ``QKVParallelLinear``
(``vllm/model_executor/layers/linear.py``) and ``ModelConfig.get_num_kv_heads``
/ ``verify_with_parallel_config`` (``vllm/config/model.py``).

No torch.distributed here: the engine calls ``check_tensor_parallel_size``
before it starts a single worker process, so that a model that cannot be
split is refused with the reason, not with a failed assertion in N processes.
"""

from __future__ import annotations

from typing import Any


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator / denominator``, which must be exact; ValueError naming both otherwise."""
    if denominator < 1 or numerator % denominator:
        raise ValueError(f"The {what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}).")
    return numerator // denominator


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """How many KV heads one rank holds (vLLM's rule).

    More KV heads than ranks: each rank gets an equal share (8 heads, 2 ranks:
    4 each). Fewer: every rank holds one, and each head is *replicated* on
    ``tp_size // total_num_kv_heads`` ranks (1 head, 2 ranks: both hold it),
    because a query head needs its whole K and V, and splitting a head's
    ``head_dim`` would break attention's dot products.
    """
    if tp_size >= total_num_kv_heads:
        divide(tp_size, total_num_kv_heads, "tensor-parallel size over the KV heads")
        return 1
    return divide(total_num_kv_heads, tp_size, "number of KV heads")


def first_kv_head_of_rank(total_num_kv_heads: int, tp_size: int, rank: int) -> int:
    """The first KV head ``rank`` holds: rank * heads_per_rank, or, replicated, the
    head shared by ranks [h * replicas, (h + 1) * replicas)."""
    return rank * total_num_kv_heads // tp_size


def check_tensor_parallel_size(hf_text_config: Any, tp_size: int) -> None:
    """Refuse (ValueError, with both numbers) a model that ``tp_size`` ranks cannot split.

    * ``tp_size`` must divide the attention heads (each rank runs whole heads);
    * the KV heads must split evenly or be replicated evenly (``kv_heads_per_rank``);
    * the MLP's ``intermediate_size`` must split evenly;
    * hybrid models (a ``layer_types`` entry ``"linear_attention"``, Qwen3.5)
      only run at ``tp_size`` 1: their Gated DeltaNet layers are not sharded.
    """
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp_size}.")
    if tp_size == 1:
        return
    if "linear_attention" in (getattr(hf_text_config, "layer_types", None) or []):
        raise ValueError(
            f"tensor_parallel_size={tp_size}: hybrid models (Gated DeltaNet layers, e.g. Qwen3.5) run "
            "only at tensor_parallel_size=1 in nanoengine; sharding the Gated DeltaNet layers is not built."
        )
    num_heads = int(hf_text_config.num_attention_heads)
    if num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide the number of attention heads ({num_heads})."
        )
    num_kv_heads = int(getattr(hf_text_config, "num_key_value_heads", None) or num_heads)
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide the number of KV heads ({num_kv_heads}) "
            "or be a multiple of it (each KV head then replicated on several ranks)."
        )
    intermediate_size = int(hf_text_config.intermediate_size)
    if intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide the MLP's intermediate_size ({intermediate_size})."
        )
