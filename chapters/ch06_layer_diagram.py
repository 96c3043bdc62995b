"""Chapter 6's diagram of one decoder layer split over N ranks, drawn from the model itself.

The docs macro ``{{ tp_layer_diagram() }}`` calls ``layer_diagram`` at build
time: it builds the walkthrough's model (the Qwen3-0.6B shapes of
``chapters/ch06_tensor_parallel.py``) on two real tensor-parallel ranks --
spawned processes in one gloo group, each building the model on PyTorch's
meta device (real shapes, no memory) -- reads every parameter's slice with
``model_weight_shards``, and turns layer 0's slices into a mermaid flowchart:
column-parallel projections, attention on each rank's own heads,
row-parallel projections whose partial sums meet in an all-reduce.

    python -m chapters.ch06_layer_diagram    # prints the mermaid source
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig

from chapters.ch06_tensor_parallel import DEFAULT_MODEL_STAND_IN, shape_text
from chapters.grade_checks.tp_ranks import run_on_ranks
from nanoengine.distributed.utils import kv_heads_per_rank
from nanoengine.instruments.tp_inspection import WeightShard, model_weight_shards
from nanoengine.transformers_utils.dummy_configs import BUILTIN_CONFIGS
from nanoengine.worker.kv_cache_spec import meta_model

# The two halves of a decoder layer: (the norm before it, the module holding its projections).
SUBLAYERS = (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))


def _shards_of_meta_model(config: dict[str, Any]) -> list[WeightShard]:
    """On one rank (its TP group already set up): the model built on the meta device, its slices."""
    fields = {key: value for key, value in config.items() if key != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    return model_weight_shards(meta_model(hf_config, torch.float32))


def shards_on_ranks(config: dict[str, Any], world_size: int = 2) -> list[list[WeightShard]]:
    """Every rank's parameters for a model of ``config`` (a config.json dict), in rank order."""
    shards: list[list[WeightShard]] = run_on_ranks(_shards_of_meta_model, config, world_size=world_size)
    return shards


def _layer_zero(shards: list[WeightShard], sublayer: str, split_dim: int) -> list[WeightShard]:
    """Layer 0's weights under ``sublayer`` split along ``split_dim``, in model order."""
    prefix = f".layers.0.{sublayer}."
    return [s for s in shards if prefix in s.name and s.name.endswith(".weight") and s.split_dim == split_dim]


def _projection_box(rank: int, shard: WeightShard) -> str:
    """A box's text: the rank, the projection's name and its slice, of the whole checkpoint tensor."""
    projection = shard.name.rsplit(".", 2)[-2]  # model.layers.0.self_attn.qkv_proj.weight -> qkv_proj
    return (f"rank {rank}: {projection} {shape_text(shard.shape)}<br/>{shard.layer_type}, "
            f"of {shape_text(shard.full_shape)}")


def layer_split_mermaid(shards: list[list[WeightShard]], config: dict[str, Any]) -> str:
    """A mermaid flowchart of decoder layer 0 on ``len(shards)`` ranks, shapes from ``shards``."""
    world_size = len(shards)
    hidden = config["hidden_size"]
    q_heads = config["num_attention_heads"] // world_size
    kv_heads = kv_heads_per_rank(config["num_key_value_heads"], world_size)
    intermediate = config["intermediate_size"] // world_size
    lines = ["flowchart TB", f'    in["hidden [T, {hidden}]<br/>the same on every rank"]']
    previous = "in"
    for index, (norm, sublayer) in enumerate(SUBLAYERS):
        norm_node, reduce_node = f"norm{index}", f"reduce{index}"
        lines.append(f'    {previous} --> {norm_node}["{norm}<br/>whole weight on every rank"]')
        for rank, rank_shards in enumerate(shards):
            chain = [_projection_box(rank, s) for s in _layer_zero(rank_shards, sublayer, 0)]
            if sublayer == "self_attn":
                chain.append(f"rank {rank}: attention over its {q_heads} query heads, {kv_heads} KV heads")
            else:
                chain.append(f"rank {rank}: SiLU(gate) x up<br/>[T, {intermediate}] of [T, {config['intermediate_size']}]")
            chain += [f"{_projection_box(rank, s)}<br/>a partial sum [T, {hidden}]"
                      for s in _layer_zero(rank_shards, sublayer, 1)]
            node = norm_node
            for step, text in enumerate(chain):
                lines.append(f'    {node} --> s{index}r{rank}n{step}["{text}"]')
                node = f"s{index}r{rank}n{step}"
            lines.append(f"    {node} --> {reduce_node}")
        lines.append(f'    {reduce_node}(("all-reduce<br/>sum of {world_size}"))')
        previous = reduce_node
    lines.append(f'    {previous} --> out["hidden [T, {hidden}]<br/>the same on every rank, plus the residual"]')
    return "\n".join(lines)


def layer_diagram(world_size: int = 2) -> str:
    """The stand-in model's layer 0 at ``world_size`` ranks, as a mermaid block's body."""
    config = BUILTIN_CONFIGS[DEFAULT_MODEL_STAND_IN].config
    return layer_split_mermaid(shards_on_ranks(config, world_size), config)


if __name__ == "__main__":
    print(layer_diagram())
