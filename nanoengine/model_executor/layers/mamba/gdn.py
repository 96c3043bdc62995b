"""Gated DeltaNet: the linear-attention layer of Qwen3.5's hybrid decoder.

Chapter 7 (the forward pass; a hybrid model's second kind of layer); the
notes' chapter 5 meets these layers in the coordinator, where their state is
a fixed-size block per request rather than a growing list of KV blocks.
vLLM 0.32 counterpart: ``vllm/model_executor/layers/mamba/gdn/base.py``
(``GatedDeltaNetAttention``) and its Qwen subclass in
``vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``
(``QwenGatedDeltaNetAttention``), with ``RMSNormGated`` from
``layers/layernorm.py``.

Where an attention layer keeps every past token's K and V, this layer keeps
two fixed-size tensors per request, whatever its length:

* a **conv state** [conv_dim, K - 1]: the last K - 1 projected inputs, for the
  short causal convolution that mixes each channel with its recent past;
* an **ssm state** [num_v_heads, k_head_dim, v_head_dim]: one matrix per value
  head, the associative memory of the gated delta rule (``ops.py``).

Per token: project to q, k, v (through the convolution), a gate z, and two
per-head scalars: beta = sigmoid(b), how strongly this token rewrites the
memory, and g = -exp(A_log) * softplus(a + dt_bias) <= 0, the log of how much
of the memory survives it. q and k are l2-normalised, the rule runs, and its
output is RMS-normalised per head and gated by silu(z) before ``out_proj``.

The states live in tensors shared by all requests (bound by
``bind_mamba_state``, as ``bind_kv_cache`` binds KV caches), one *slot* per
request: ``attn_metadata.state_indices[state_group, i]`` is request i's. A
request with nothing computed yet starts from zeros; any other continues from
its slot (the next chunk of a prefill, or a decode), and the slot holds the
state after its last scheduled token once the step is done.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from nanoengine.model_executor.layers.mamba.ops import (
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule_step,
)


class RMSNormGated(nn.Module):
    """``rmsnorm(x) * weight * silu(gate)`` over the last dim (norm before gate).

    Unlike the decoder's norms this weight is *not* zero-centred: it starts at
    ones and multiplies directly, as in HF's ``Qwen3_5RMSNormGated``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate [..., hidden] -> [..., hidden]. HF's rounding order: statistics
        # in fp32, cast back before the weight, gate in fp32, one final cast.
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        normed = (x32 * inv_rms).to(x.dtype)
        return ((self.weight * normed) * F.silu(gate.float())).to(x.dtype)


class DepthwiseConv1d(nn.Module):
    """The layer's short convolution: one K-wide kernel per channel, no bias.

    Only holds the weight, [channels, 1, K] as the checkpoint stores it
    (``nn.Conv1d``'s depthwise layout); the causal arithmetic with a carried
    state is in ``ops.py``.
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One request: x [T, C], state [C, K - 1] -> (out [T, C], new state)."""
        return causal_conv1d(x, self.weight[:, 0], state)

    def update(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token each of B requests: x [B, C], state [B, C, K - 1]."""
        return causal_conv1d_update(x, self.weight[:, 0], state)


class GatedDeltaNetAttention(nn.Module):
    """Projections -> causal conv -> gated delta rule -> gated norm -> ``out_proj``.

    ``in_proj_qkvz`` fuses the checkpoint's ``in_proj_qkv`` and ``in_proj_z``
    (shards "qkv" and "z"), ``in_proj_ba`` its ``in_proj_b`` and ``in_proj_a``
    (shards "b" and "a"), as vLLM fuses them.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"Gated DeltaNet's convolution uses SiLU; the config asks for {config.hidden_act!r}."
            )
        self.num_k_heads = int(config.linear_num_key_heads)
        self.num_v_heads = int(config.linear_num_value_heads)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})."
            )
        self.head_k_dim = int(config.linear_key_head_dim)
        self.head_v_dim = int(config.linear_value_head_dim)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        # q, k and v all pass through the convolution; z, b and a do not.
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = int(config.linear_conv_kernel_dim)
        hidden_size = config.hidden_size

        # Built with the parallel layers at one rank only: a hybrid model refuses
        # tensor_parallel_size > 1 (distributed/utils.check_tensor_parallel_size),
        # because splitting these projections by head is not built.
        self.in_proj_qkvz = MergedColumnParallelLinear(
            hidden_size, [self.conv_dim, self.value_dim], shard_ids=("qkv", "z")
        )
        self.in_proj_ba = MergedColumnParallelLinear(hidden_size, [self.num_v_heads] * 2, shard_ids=("b", "a"))
        self.conv1d = DepthwiseConv1d(self.conv_dim, self.conv_kernel_size)
        # Per value head: the decay rate (stored as log A) and the softplus shift.
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.value_dim, hidden_size)

        # Plain attributes, like Attention.kv_cache: shared engine memory, not
        # model state (no state_dict entry, not moved by model.to). Bound by
        # bind_mamba_state to [num_slots, *shape] for the shapes of get_state_shape.
        self.conv_state: torch.Tensor = torch.empty(0)
        self.ssm_state: torch.Tensor = torch.empty(0)
        # Which row of attn_metadata.state_indices names this layer's slots.
        self.state_group = 0

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes: conv state (conv_dim, K - 1), ssm state (Hv, Dk, Dv)."""
        return (
            (self.conv_dim, self.conv_kernel_size - 1),
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    def forward(self, hidden: torch.Tensor, attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; reads and updates the bound states.

        Rows past ``num_actual_tokens`` (padding a runner may add) are not run
        through the rule; they come out as the projection of zeros.
        """
        md = self._check_ready(attn_metadata)
        mixed_qkv, z = self.in_proj_qkvz(hidden).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).chunk(2, dim=-1)  # [T, Hv] each
        beta = b.sigmoid()
        # fp32, as HF: in bf16 exp(A_log) alone would round the decay coarsely.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

        core = hidden.new_zeros(hidden.shape[0], self.num_v_heads, self.head_v_dim)
        qsl = md.query_start_loc_cpu
        if md.num_decodes > 0:
            # Decodes come first and own one row each: rows 0 .. num_decodes - 1.
            rows = slice(0, md.num_decodes)
            core[rows] = self._decode_batch(mixed_qkv[rows], g[rows], beta[rows], md)
        for i in range(md.num_decodes, md.num_reqs):
            rows = slice(qsl[i], qsl[i + 1])
            core[rows] = self._prefill_one(mixed_qkv[rows], g[rows], beta[rows], md, i)

        gate = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        return self.out_proj(self.norm(core, gate).flatten(-2))

    def _check_ready(self, attn_metadata: AttentionMetadata | None) -> AttentionMetadata:
        if attn_metadata is None or attn_metadata.state_indices is None:
            raise ValueError(
                "A Gated DeltaNet layer needs AttentionMetadata with state_indices (each request's "
                "state slot) to read and write its conv and ssm states."
            )
        if self.conv_state.dim() != 3 or self.ssm_state.dim() != 4:
            raise RuntimeError(
                "This Gated DeltaNet layer has no state tensors yet; call bind_mamba_state(model, states) first."
            )
        return attn_metadata

    def _decode_batch(
        self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """One token for each decode request, batched. x [B, conv_dim] -> [B, Hv, Dv]."""
        slots = self._slots(md)[: md.num_decodes]
        # A one-token prompt is scheduled as a "decode" yet has no state to continue.
        continuing = [md.seq_lens_cpu[i] > 1 for i in range(md.num_decodes)]
        conv_state, ssm_state = self._load(slots, continuing)
        x, conv_state = self.conv1d.update(x, conv_state)
        q, k, v = self._split_heads(x)
        out, ssm_state = recurrent_gated_delta_rule_step(q, k, v, g, beta, ssm_state)
        self._store(slots, conv_state, ssm_state)
        return out

    def _prefill_one(
        self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, md: AttentionMetadata, req: int
    ) -> torch.Tensor:
        """A whole prompt or one chunk of request ``req``. x [T, conv_dim] -> [T, Hv, Dv]."""
        slots = self._slots(md)[req : req + 1]  # [1]: keeps the index on the device
        # Tokens computed by earlier steps (seq_len counts this chunk too).
        continuing = md.seq_lens_cpu[req] > x.shape[0]
        conv_state, ssm_state = self._load(slots, [continuing])
        x, new_conv = self.conv1d(x, conv_state[0])
        q, k, v = self._split_heads(x)
        out, new_ssm = chunk_gated_delta_rule(q, k, v, g, beta, ssm_state[0])
        self._store(slots, new_conv[None], new_ssm[None])
        return out

    def _slots(self, md: AttentionMetadata) -> torch.Tensor:
        assert md.state_indices is not None, "checked by _check_ready"
        return md.state_indices[self.state_group]  # [num_reqs] int64

    def _load(self, slots: torch.Tensor, continuing: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """States of ``slots``, zeros for requests that start here.

        Returns conv [B, conv_dim, K - 1] and ssm [B, Hv, Dk, Dv] copies.
        ``torch.where``, not a multiply: a slot freed by an earlier request may
        hold anything, and 0 * inf is NaN.
        """
        conv_state = self.conv_state.index_select(0, slots)
        ssm_state = self.ssm_state.index_select(0, slots)
        if all(continuing):
            return conv_state, ssm_state
        keep = torch.tensor(continuing, device=slots.device)
        return (
            torch.where(keep[:, None, None], conv_state, 0),
            torch.where(keep[:, None, None, None], ssm_state, 0),
        )

    def _store(self, slots: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Write the states after this step back to their slots, in the storage dtype."""
        self.conv_state.index_copy_(0, slots, conv_state.to(self.conv_state.dtype))
        self.ssm_state.index_copy_(0, slots, ssm_state.to(self.ssm_state.dtype))

    def _split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [N, conv_dim] -> q, k [N, Hk, Dk] (unit length, fp32), v [N, Hv, Dv]."""
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.unflatten(-1, (self.num_k_heads, self.head_k_dim)))
        k = l2norm(k.unflatten(-1, (self.num_k_heads, self.head_k_dim)))
        return q, k, v.unflatten(-1, (self.num_v_heads, self.head_v_dim))

    def extra_repr(self) -> str:
        return (
            f"k_heads={self.num_k_heads}, v_heads={self.num_v_heads}, k_dim={self.head_k_dim}, "
            f"v_dim={self.head_v_dim}, conv_kernel={self.conv_kernel_size}"
        )


def bind_mamba_state(
    model: nn.Module, states: list[tuple[torch.Tensor, torch.Tensor]], state_groups: list[int] | None = None
) -> None:
    """Give each Gated DeltaNet layer of ``model``, in layer order, its (conv_state, ssm_state).

    The counterpart of ``bind_kv_cache``, which binds the full-attention
    layers of the same model. ``states[j]`` is ([num_slots, conv_dim, K - 1],
    [num_slots, Hv, Dk, Dv]) for the j-th such layer (see ``get_state_shape``);
    ``state_groups[j]``, if given, is the row of ``state_indices`` it reads.
    """
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNetAttention)]
    if len(layers) != len(states):
        raise ValueError(
            f"The model has {len(layers)} Gated DeltaNet layers but {len(states)} state pairs were given."
        )
    if state_groups is not None and len(state_groups) != len(layers):
        raise ValueError(f"state_groups has {len(state_groups)} entries for {len(layers)} layers.")
    for j, (layer, (conv_state, ssm_state)) in enumerate(zip(layers, states)):
        conv_shape, ssm_shape = layer.get_state_shape()
        if tuple(conv_state.shape[1:]) != conv_shape or tuple(ssm_state.shape[1:]) != ssm_shape:
            raise ValueError(
                f"Gated DeltaNet layer {j} wants states [num_slots, {conv_shape}] and "
                f"[num_slots, {ssm_shape}], got {tuple(conv_state.shape)} and {tuple(ssm_state.shape)}."
            )
        layer.conv_state, layer.ssm_state = conv_state, ssm_state
        if state_groups is not None:
            layer.state_group = state_groups[j]
