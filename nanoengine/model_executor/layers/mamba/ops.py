"""The two sequence operators of a Gated DeltaNet layer, in plain torch.

Chapter 7 (the forward pass of a hybrid model: the layers that keep a state
instead of a KV cache). vLLM 0.32 counterparts:
``vllm/model_executor/layers/mamba/ops/causal_conv1d.py`` (``causal_conv1d_fn``,
``causal_conv1d_update``) and the FLA kernels under
``vllm/third_party/flash_linear_attention/ops/`` (``chunk_gated_delta_rule``
in ``chunk.py``, ``fused_recurrent_gated_delta_rule`` in
``fused_recurrent.py``), which are Triton; these are the same
arithmetic written to be read.

Each operator comes twice, because prefill and decode want different shapes:

* **Causal depthwise conv1d.** Every channel is convolved with its own short
  kernel (width K, 4 in Qwen3.5) over the last K tokens. The *conv state* is
  the K - 1 inputs before the current ones: a prefill chunk is prepended with
  it and leaves the last K - 1 inputs behind (``causal_conv1d``); a decode
  token shifts it by one (``causal_conv1d_update``).
* **The gated delta rule.** Per value head, a state matrix S [k_dim, v_dim]
  is decayed, corrected and read for every token t::

      S   <- exp(g_t) * S                      (forget a little)
      u_t  = beta_t * (v_t - S^T k_t)          (what S mispredicts for k_t)
      S   <- S + k_t u_t^T                     (write the correction)
      o_t  = S^T (scale * q_t)                 (read)

  Decode runs exactly that, one token per request, batched
  (``recurrent_gated_delta_rule_step``). A prefill would need one small
  update per token; ``chunk_gated_delta_rule`` instead solves a chunk of C
  tokens at once with a triangular solve and matmuls, carrying S only from
  chunk to chunk (the derivation is in ``_delta_rule_chunk``).

Both rules take the starting state and return the final one, in fp32
(the caller stores it in its own dtype). Key heads may be fewer than value
heads: each key/query head then serves a group of consecutive value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# FLA's (and HF's) chunk length: long enough for the matmuls to pay off, short
# enough that the [C, C] triangular solve stays cheap.
DEFAULT_CHUNK_SIZE = 64


# ---- causal depthwise conv1d --------------------------------------------------


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens through the convolution, then SiLU.

    x [T, C] (this step's inputs); weight [C, K]; conv_state [C, K - 1] (the
    K - 1 inputs before x, zeros for a fresh request). Returns
    (out [T, C] in x's dtype, new conv_state [C, K - 1]: the last K - 1 inputs).
    """
    width = weight.shape[1] - 1
    # [C, K - 1 + T]: the state supplies the left context no padding could.
    window = torch.cat((conv_state.to(x.dtype), x.transpose(0, 1)), dim=1)
    # groups=C: channel c sees only its own row of weight ([C, 1, K] for conv1d);
    # with no padding, output j covers inputs j .. j + K - 1 = the K ending at token j.
    out = F.conv1d(window[None], weight[:, None, :].to(x.dtype), groups=x.shape[1])[0]
    # Fewer than K - 1 new tokens keep some of the old state, hence the slice.
    return F.silu(out).transpose(0, 1), window[:, window.shape[1] - width :]


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests (decode).

    x [B, C]; weight [C, K]; conv_state [B, C, K - 1]. Returns
    (out [B, C], new conv_state [B, C, K - 1]: the old one shifted left by x).
    """
    # [B, C, K]: the K - 1 previous inputs and this one, oldest first.
    window = torch.cat((conv_state.to(x.dtype), x[:, :, None]), dim=2)
    out = (window * weight.to(x.dtype)).sum(dim=-1)
    return F.silu(out), window[:, :, 1:]


# ---- the gated delta rule -----------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim, in fp32: ``x * rsqrt(sum(x^2) + eps)`` (FLA's form,
    which HF copies; F.normalize clamps the norm instead and differs near 0).

    Unit-length keys keep the delta rule stable: with beta in (0, 1) a write
    never overshoots what it corrects.
    """
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).sum(dim=-1, keepdim=True) + eps)


def _repeat_key_heads(x: torch.Tensor, num_v_heads: int, head_dim: int) -> torch.Tensor:
    """[..., num_k_heads, D] -> [..., num_v_heads, D] fp32: key head h serves value
    heads h * G .. h * G + G - 1, G = num_v_heads / num_k_heads (HF's layout)."""
    return x.float().repeat_interleave(num_v_heads // x.shape[head_dim], dim=head_dim)


def recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: the rule of the module docstring, as written.

    q, k [B, Hk, Dk] (l2-normalised by the caller); v [B, Hv, Dv]; g (log
    decay, <= 0) and beta [B, Hv]; state [B, Hv, Dk, Dv]. ``scale`` defaults to
    Dk ** -0.5. Returns (out [B, Hv, Dv] in v's dtype, new state [B, Hv, Dk, Dv] fp32).
    """
    num_v_heads = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q32 = _repeat_key_heads(q, num_v_heads, 1) * scale  # [B, Hv, Dk]
    k32 = _repeat_key_heads(k, num_v_heads, 1)
    s = state.float() * g.float().exp()[:, :, None, None]  # decay: [B, Hv, Dk, Dv]
    # What the decayed state already returns for k_t: [B, Hv, Dv]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k32)
    correction = beta.float()[:, :, None] * (v.float() - predicted)
    s = s + k32[:, :, :, None] * correction[:, :, None, :]  # outer product k_t u_t^T
    out = torch.einsum("bhkv,bhk->bhv", s, q32)
    return out.to(v.dtype), s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's T tokens, C = ``chunk_size`` at a time (the last chunk may be shorter).

    q, k [T, Hk, Dk] (l2-normalised by the caller); v [T, Hv, Dv]; g, beta
    [T, Hv]; initial_state [Hv, Dk, Dv]. Returns (out [T, Hv, Dv] in v's dtype,
    final state [Hv, Dk, Dv] fp32): what T recurrent steps would give.
    """
    num_v_heads = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # Heads first, fp32 throughout: [Hv, T, D] and [Hv, T].
    q32 = _repeat_key_heads(q, num_v_heads, 1).transpose(0, 1) * scale
    k32 = _repeat_key_heads(k, num_v_heads, 1).transpose(0, 1)
    v32 = v.float().transpose(0, 1)
    g32, beta32 = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    state = initial_state.float()
    outs = []
    for start in range(0, v.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        out, state = _delta_rule_chunk(
            q32[:, part], k32[:, part], v32[:, part], g32[:, part], beta32[:, part], state
        )
        outs.append(out)
    # An empty request never reaches here (a prefill has at least one token).
    return torch.cat(outs, dim=1).transpose(0, 1).to(v.dtype), state


def _delta_rule_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """C tokens of the rule at once, per head. q (already scaled), k [H, C, Dk];
    v [H, C, Dv]; g, beta [H, C]; state [H, Dk, Dv]: S before the chunk. All fp32.

    Let G_t = g_1 + ... + g_t (log decay since the chunk began) and
    d(t, s) = exp(G_t - G_s) for s <= t (how much of token s's write survives
    to t). Unrolling the rule from S_0 = ``state``:

        S_t = exp(G_t) S_0 + sum_{s <= t} d(t, s) k_s u_s^T
        u_t = beta_t (v_t - exp(G_t) S_0^T k_t - sum_{s < t} d(t, s) (k_t . k_s) u_s)

    so the corrections U [C, Dv] solve one unit lower-triangular system
    (I + A) U = beta V - beta exp(G) K S_0, A[t, s] = beta_t d(t, s) (k_t . k_s)
    for s < t. Then every output and the state after the chunk are matmuls:

        O   = exp(G) Q S_0 + (Q K^T * d, lower incl. diagonal) U
        S_C = exp(G_C) S_0 + (d(C, s) K)^T U

    Returns (out [H, C, Dv], state after the chunk [H, Dk, Dv]).
    """
    length = g.shape[1]
    cum = g.cumsum(dim=1)  # G_t: [H, C], non-increasing since g <= 0
    # [C, C] True where s <= t. Above the diagonal G_t - G_s > 0 and exp could
    # overflow, so those entries are zeroed *before* exp, not after.
    causal = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    log_decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf"))
    decay = log_decay.exp()  # d(t, s): [H, C, C], 0 above the diagonal
    decay_from_start = cum.exp()[:, :, None]  # exp(G_t): [H, C, 1]
    beta_ = beta[:, :, None]  # [H, C, 1]

    # A, strictly lower: the diagonal is the identity of (I + A).
    strictly_lower = beta_ * (k @ k.transpose(1, 2)) * decay.tril(diagonal=-1)
    system = strictly_lower + torch.eye(length, dtype=g.dtype, device=g.device)
    rhs = beta_ * v - (beta_ * decay_from_start * k) @ state  # [H, C, Dv]
    corrections = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)

    out = (decay_from_start * q) @ state + ((q @ k.transpose(1, 2)) * decay) @ corrections
    # d(C, s) = exp(G_C - G_s): how much of each write is left at the chunk's end.
    survive = (cum[:, -1:] - cum).exp()[:, :, None]  # [H, C, 1]
    new_state = cum[:, -1].exp()[:, None, None] * state + (survive * k).transpose(1, 2) @ corrections
    return out, new_state
