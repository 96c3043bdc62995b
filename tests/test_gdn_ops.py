"""The Gated DeltaNet ops (layers/mamba/ops.py): each form against the other, and HF's.

* The chunked delta rule (prefill) must give what token-by-token recurrent
  steps (decode) give, output and final state, from a zero or a random
  initial state, for lengths that are not multiples of the chunk, with key
  heads shared by groups of value heads; and two calls handing the state on
  must equal one call (what chunked prefill across steps relies on).
* The sequence convolution with a carried state must equal one-token updates.
* Both against HF transformers' plain-torch versions
  (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
  ``causal_conv1d_fn``, ``causal_conv1d_update``), written independently.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from nanoengine.model_executor.layers.mamba.ops import (
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule_step,
)

ATOL = 1e-5
DK, DV, CHANNELS, KERNEL = 16, 8, 24, 4


class RuleInputs(NamedTuple):
    """The five per-token inputs of the rule, in the ops' argument order; dim 0 is the token."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def tokens(self, rows: slice) -> RuleInputs:
        return RuleInputs(*(x[rows] for x in self))

    def batched(self) -> RuleInputs:
        """With a leading batch dim of one, as HF's functions take them."""
        return RuleInputs(*(x[None] for x in self))


def rule_inputs(length: int, num_k_heads: int, num_v_heads: int, seed: int = 0) -> RuleInputs:
    """Unit-length q/k, g in the model's range (up to e^-3 of decay per token), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return RuleInputs(
        q=l2norm(torch.randn(length, num_k_heads, DK, generator=gen)),
        k=l2norm(torch.randn(length, num_k_heads, DK, generator=gen)),
        v=torch.randn(length, num_v_heads, DV, generator=gen),
        g=-3 * torch.rand(length, num_v_heads, generator=gen),
        beta=torch.rand(length, num_v_heads, generator=gen),
    )


def initial_state(num_v_heads: int, random: bool) -> torch.Tensor:
    if not random:
        return torch.zeros(num_v_heads, DK, DV)
    return torch.randn(num_v_heads, DK, DV, generator=torch.Generator().manual_seed(7))


def recurrent(x: RuleInputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence one token at a time through the decode step (batch of one)."""
    outs = []
    s = state[None]
    for t in range(x.v.shape[0]):
        out, s = recurrent_gated_delta_rule_step(*x.tokens(slice(t, t + 1)), state=s)
        outs.append(out)
    return torch.cat(outs), s[0]


HEADS = pytest.mark.parametrize("num_k_heads,num_v_heads", [(2, 2), (2, 4)], ids=["mha", "grouped"])
STATE = pytest.mark.parametrize("random_state", [False, True], ids=["zero", "carried"])


@HEADS
@STATE
@pytest.mark.parametrize("length,chunk_size", [(1, 16), (15, 16), (16, 16), (50, 16), (130, 64)])
def test_chunked_rule_equals_recurrent_steps(
    length: int, chunk_size: int, num_k_heads: int, num_v_heads: int, random_state: bool
) -> None:
    x = rule_inputs(length, num_k_heads, num_v_heads)
    state = initial_state(num_v_heads, random_state)
    out, final = chunk_gated_delta_rule(*x, initial_state=state, chunk_size=chunk_size)
    expected_out, expected_final = recurrent(x, state)
    assert out.shape == (length, num_v_heads, DV) and final.shape == (num_v_heads, DK, DV)
    torch.testing.assert_close(out, expected_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, expected_final, atol=ATOL, rtol=0)


@HEADS
def test_chunked_rule_split_across_calls(num_k_heads: int, num_v_heads: int) -> None:
    """Prefill in pieces (37 + 1 + 42 tokens), each starting from the last one's state."""
    x = rule_inputs(80, num_k_heads, num_v_heads, seed=1)
    whole_out, whole_final = chunk_gated_delta_rule(*x, initial_state=initial_state(num_v_heads, True))
    state = initial_state(num_v_heads, True)
    outs = []
    for piece in (slice(0, 37), slice(37, 38), slice(38, 80)):
        out, state = chunk_gated_delta_rule(*x.tokens(piece), initial_state=state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), whole_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, whole_final, atol=ATOL, rtol=0)


@HEADS
@STATE
def test_rules_match_hf(num_k_heads: int, num_v_heads: int, random_state: bool) -> None:
    """Ours against HF's two reference implementations (batch of one, q/k normalised here)."""
    x = rule_inputs(70, num_k_heads, num_v_heads, seed=2)
    state = initial_state(num_v_heads, random_state)
    hf_chunk, hf_chunk_final = hf.torch_chunk_gated_delta_rule(
        *x.batched(), initial_state=state[None], output_final_state=True
    )
    hf_rec, hf_rec_final = hf.torch_recurrent_gated_delta_rule(
        *x.batched(), initial_state=state[None], output_final_state=True
    )
    out, final = chunk_gated_delta_rule(*x, initial_state=state)
    torch.testing.assert_close(out, hf_chunk[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(final, hf_chunk_final[0], atol=ATOL, rtol=0)
    rec_out, rec_final = recurrent(x, state)
    torch.testing.assert_close(rec_out, hf_rec[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(rec_final, hf_rec_final[0], atol=ATOL, rtol=0)


def test_rule_keeps_the_input_dtype_and_returns_an_fp32_state() -> None:
    x = RuleInputs(*(t.to(torch.bfloat16) for t in rule_inputs(20, 2, 4)))
    state = initial_state(4, True).to(torch.bfloat16)
    out, final = chunk_gated_delta_rule(*x, initial_state=state)
    step_out, step_final = recurrent_gated_delta_rule_step(*x.tokens(slice(0, 1)), state=state[None])
    assert out.dtype == step_out.dtype == torch.bfloat16
    assert final.dtype == step_final.dtype == torch.float32


def test_l2norm_matches_hf() -> None:
    x = torch.randn(5, 3, DK)
    torch.testing.assert_close(l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6))
    torch.testing.assert_close(l2norm(x).norm(dim=-1), torch.ones(5, 3))


def conv_inputs(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(length, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, KERNEL, generator=gen)
    state = torch.randn(CHANNELS, KERNEL - 1, generator=gen)
    return x, weight, state


@pytest.mark.parametrize("length", [1, 2, 3, 4, 11])
def test_conv1d_sequence_equals_single_token_updates(length: int) -> None:
    """Lengths below, at and above the K - 1 = 3 columns of state."""
    x, weight, state = conv_inputs(length)
    out, new_state = causal_conv1d(x, weight, state)
    step_state = state[None]
    for t in range(length):
        step_out, step_state = causal_conv1d_update(x[t : t + 1], weight, step_state)
        torch.testing.assert_close(out[t : t + 1], step_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(new_state, step_state[0], atol=0, rtol=0)
    # The state is the last K - 1 inputs, reaching into the old state when x is short.
    torch.testing.assert_close(new_state, torch.cat((state, x.T), dim=1)[:, -(KERNEL - 1) :])


@pytest.mark.parametrize("length", [1, 9])
def test_conv1d_matches_hf(length: int) -> None:
    """From a zero state, HF's causal_conv1d_fn; one token, HF's causal_conv1d_update."""
    x, weight, state = conv_inputs(length)
    out, _ = causal_conv1d(x, weight, torch.zeros(CHANNELS, KERNEL - 1))
    hf_out = hf.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    torch.testing.assert_close(out, hf_out, atol=ATOL, rtol=0)

    hf_state = state[None].clone()  # HF updates its state in place
    hf_step = hf.causal_conv1d_update(x[:1, :, None], hf_state, weight, None, activation="silu")
    step_out, step_state = causal_conv1d_update(x[:1], weight, state[None])
    torch.testing.assert_close(step_out, hf_step[:, :, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(step_state, hf_state)
