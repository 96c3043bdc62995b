"""Qwen3.5's text model against HF transformers' own, on tiny random weights in fp32.

Our model is loaded from HF's state_dict through ``load_weights`` and run the
engine's way, over a paged KV cache (full-attention layers) and per-request
state slots (Gated DeltaNet layers), with metadata built here step by step.
Its logits must match HF's full-sequence forward for a prompt prefilled at
once, in chunks across steps, in mixed batches, and its greedy decode must
match HF's ``generate``; in bf16 it must stay as close to those fp32 logits
as HF's own bf16 model. Also: partial rotary against HF's mrope, the
multimodal checkpoint layout, and the registry entries.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5TextConfig
from transformers import Qwen3_5ForCausalLM as HFQwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

from nanoengine._custom_ops import cpu_ops_available
from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.attention.layer import Attention, bind_kv_cache, set_attention_impl
from nanoengine.attention.selector import get_attention_impl
from nanoengine.model_executor.custom_op import enable_cpu_kernels
from nanoengine.model_executor.layers.mamba.gdn import GatedDeltaNetAttention, bind_mamba_state
from nanoengine.model_executor.layers.rotary_embedding import get_rope
from nanoengine.model_executor.model_loader.loader import default_dtype
from nanoengine.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM
from nanoengine.model_executor.models.registry import get_model_class

LIN, FULL = "linear_attention", "full_attention"
LAYER_PATTERNS = {"LLLF": [LIN, LIN, LIN, FULL], "FLFL": [FULL, LIN, FULL, LIN]}
# The C++ backend runs the full-attention layers where it builds; head_dim 32 is
# one its tiled prefill kernel takes (a multiple of 32).
BACKENDS = ["torch"] + (["cpu"] if cpu_ops_available() else [])
VOCAB = 128
BLOCK_SIZE = 8
NUM_BLOCKS = 64
NUM_SLOTS = 8
# fp32 logits of a chunked delta rule carry rounding that grows with the prompt:
# on a 70-token prompt HF's own fp32 logits sit up to 1.1e-4 from a float64 run
# (Intel Xeon with AMX; about half that on AMD EPYC), ours up to 1.9e-4. A wrong
# gate, decay or state hand-over moves logits by 1e-2 or more.
ATOL = 5e-4


def tiny_text_config(layer_types: list[str], tie: bool = False) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # partial rotary 0.25 -> 8 rotated dims
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )


def make_hf_model(config: Qwen3_5TextConfig, seed: int = 0) -> HFQwen3_5ForCausalLM:
    """HF's model with random weights everywhere.

    HF's init leaves every zero-centred norm at 0, the gated norm at 1 and
    dt_bias at 1: values under which a wrong 1 + w, or a dropped dt_bias,
    would go unnoticed. Those are redrawn; A_log keeps HF's draw (log of
    U(0.01, 16), a decay per token between e^-0.007 and e^-11).
    """
    torch.manual_seed(seed)
    model = HFQwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and ".linear_attn." not in name:
                param.normal_(0.0, 0.3)  # zero-centred: the scale is 1 + w
            elif name.endswith(("linear_attn.norm.weight", "dt_bias")):
                param.uniform_(0.5, 1.5)
            elif param.dim() >= 2:
                # Larger than HF's 0.02 so logits differ clearly between tokens.
                param.normal_(0.0, 0.15)
    return model


def load_ours(hf: HFQwen3_5ForCausalLM, config: Qwen3_5TextConfig | Qwen3_5Config) -> Qwen3_5ForCausalLM:
    model = Qwen3_5ForCausalLM(config)
    model.load_weights(hf.state_dict().items())
    return model.eval()


@dataclass
class Req:
    """One request's tokens and where its KV blocks and state slot are."""

    token_ids: list[int]
    blocks: list[int]
    slot: int
    num_computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] per computed token


class Engine:
    """Our model with its paged caches and state slots, driven step by step."""

    def __init__(self, model: Qwen3_5ForCausalLM, backend: str, dtype: torch.dtype = torch.float32) -> None:
        """KV caches and states in ``dtype``, the model's (the engine keeps them so)."""
        self.model = model
        set_attention_impl(model, get_attention_impl(backend))
        if backend == "cpu":
            enable_cpu_kernels(model)  # as the model runner does; partial RoPE must stay torch
        attn = [m for m in model.modules() if isinstance(m, Attention)]
        bind_kv_cache(
            model,
            [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, m.num_kv_heads, m.head_dim, dtype=dtype) for m in attn],
        )
        # NaN in every slot: a request starting from zero must never read its slot.
        states = []
        for layer in (m for m in model.modules() if isinstance(m, GatedDeltaNetAttention)):
            conv_shape, ssm_shape = layer.get_state_shape()
            nan = float("nan")
            states.append(
                (
                    torch.full((NUM_SLOTS, *conv_shape), nan, dtype=dtype),
                    torch.full((NUM_SLOTS, *ssm_shape), nan, dtype=dtype),
                )
            )
        bind_mamba_state(model, states)
        # Blocks handed out shuffled, so a request's blocks are not contiguous.
        self.free_blocks = (
            torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(1)).add(1).tolist()
        )
        self.free_slots = list(range(NUM_SLOTS - 1, -1, -1))

    def add(self, token_ids: list[int], max_new_tokens: int = 8) -> Req:
        num_blocks = -(-(len(token_ids) + max_new_tokens) // BLOCK_SIZE)
        blocks = [self.free_blocks.pop() for _ in range(num_blocks)]
        return Req(list(token_ids), blocks, self.free_slots.pop())

    @torch.no_grad()
    def step(self, batch: list[tuple[Req, int]]) -> None:
        """Run num_new more tokens of each request (decodes first), keeping every row's logits."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for req, num_new in batch:
            span = range(req.num_computed, req.num_computed + num_new)
            input_ids += req.token_ids[span.start : span.stop]
            positions += list(span)
            slot_mapping += [req.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(span.stop)
        num_decodes = next((i for i, (_, n) in enumerate(batch) if n != 1), len(batch))
        width = max(len(req.blocks) for req, _ in batch)
        block_table = torch.zeros(len(batch), width, dtype=torch.int32)
        for row, (req, _) in enumerate(batch):
            block_table[row, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        md = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            num_reqs=len(batch),
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=block_table,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            state_indices=torch.tensor([[req.slot for req, _ in batch]], dtype=torch.int64),
        )
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), md)
        logits = self.model.compute_logits(hidden)
        for i, (req, num_new) in enumerate(batch):
            req.logits += list(logits[query_start_loc[i] : query_start_loc[i + 1]])
            req.num_computed += num_new


@torch.no_grad()
def hf_logits(hf: HFQwen3_5ForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """HF's logits for every position of one sequence, computed in one forward: [T, vocab]."""
    return hf(torch.tensor([token_ids])).logits[0]


def assert_matches_hf(hf: HFQwen3_5ForCausalLM, req: Req) -> None:
    ours = torch.stack(req.logits)
    expected = hf_logits(hf, req.token_ids[: req.num_computed])
    assert expected.std() > 0.1, "logits too flat for the comparison to mean anything"
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = list(itertools.product(LAYER_PATTERNS, BACKENDS))
over_cases = pytest.mark.parametrize("pattern,backend", CASES, ids=[f"{p}-{b}" for p, b in CASES])


@pytest.fixture(scope="module")
def hf_models() -> dict[str, HFQwen3_5ForCausalLM]:
    return {name: make_hf_model(tiny_text_config(types)) for name, types in LAYER_PATTERNS.items()}


def engine_for(hf_models: dict[str, HFQwen3_5ForCausalLM], pattern: str, backend: str) -> Engine:
    hf = hf_models[pattern]
    return Engine(load_ours(hf, hf.config), backend)


@over_cases
def test_prompt_prefilled_at_once(hf_models: dict, pattern: str, backend: str) -> None:
    """75 tokens in one step: more than one 64-token chunk of the delta rule."""
    engine = engine_for(hf_models, pattern, backend)
    req = engine.add(prompt(75, seed=1))
    engine.step([(req, 75)])
    assert_matches_hf(hf_models[pattern], req)


@over_cases
def test_prompt_prefilled_in_three_chunks(hf_models: dict, pattern: str, backend: str) -> None:
    """The same kind of prompt over three steps: each chunk continues from the slot."""
    engine = engine_for(hf_models, pattern, backend)
    req = engine.add(prompt(75, seed=2))
    for num_new in (30, 2, 43):  # a 2-token chunk: shorter than the conv state
        engine.step([(req, num_new)])
    assert_matches_hf(hf_models[pattern], req)


@over_cases
def test_batch_of_mixed_length_prompts(hf_models: dict, pattern: str, backend: str) -> None:
    engine = engine_for(hf_models, pattern, backend)
    reqs = [engine.add(prompt(n, seed=10 + n)) for n in (5, 70, 17, 2)]
    engine.step([(req, len(req.token_ids)) for req in reqs])
    for req in reqs:
        assert_matches_hf(hf_models[pattern], req)


@over_cases
def test_greedy_decode_matches_hf_generate(hf_models: dict, pattern: str, backend: str) -> None:
    """Prefill, then 8 one-token steps of two requests batched, feeding back the argmax."""
    hf = hf_models[pattern]
    engine = engine_for(hf_models, pattern, backend)
    reqs = [engine.add(prompt(n, seed=20 + n)) for n in (9, 21)]
    engine.step([(req, len(req.token_ids)) for req in reqs])
    for _ in range(8):
        for req in reqs:
            req.token_ids.append(int(req.logits[-1].argmax()))
        engine.step([(req, 1) for req in reqs])
    for req in reqs:
        prompt_ids = torch.tensor([req.token_ids[:-8]])
        expected = hf.generate(prompt_ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert req.token_ids == expected[0].tolist()
        assert_matches_hf(hf, req)


@over_cases
def test_step_mixing_decodes_and_prefills(hf_models: dict, pattern: str, backend: str) -> None:
    """One step: two decodes, a one-token prompt (scheduled like a decode, fresh state),
    a prompt's second chunk and a new prompt."""
    engine = engine_for(hf_models, pattern, backend)
    a, b, c = (engine.add(prompt(n, seed=30 + n)) for n in (12, 7, 40))
    engine.step([(a, 11), (b, 7), (c, 15)])
    engine.step([(a, 1)])  # a's last prompt token as a one-token chunk
    one = engine.add(prompt(1, seed=40))
    new = engine.add(prompt(19, seed=41))
    for req in (a, b):
        req.token_ids.append(int(req.logits[-1].argmax()))
    engine.step([(a, 1), (b, 1), (one, 1), (c, 25), (new, 19)])
    for req in (a, b, c, one, new):
        assert_matches_hf(hf_models[pattern], req)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_is_as_close_to_fp32_as_hf_bf16(hf_models: dict, backend: str) -> None:
    """In bf16 (weights, activations, KV cache and states), a chunked prefill and
    decodes stay as close to HF's fp32 logits as HF's own bf16 model does."""
    hf = hf_models["LLLF"]
    with default_dtype(torch.bfloat16):
        model = load_ours(hf, hf.config)
    engine = Engine(model, backend, torch.bfloat16)
    req = engine.add(prompt(40, seed=50))
    engine.step([(req, 25)])
    engine.step([(req, 15)])
    for _ in range(4):
        req.token_ids.append(int(req.logits[-1].argmax()))
        engine.step([(req, 1)])
    token_ids = req.token_ids[: req.num_computed]
    expected = hf_logits(hf, token_ids)
    with torch.no_grad():
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([token_ids])).logits[0].float()
    hf_error = (hf_bf16 - expected).abs().max()
    assert (torch.stack(req.logits) - expected).abs().max() <= 1.5 * hf_error
    gdn = next(m for m in model.modules() if isinstance(m, GatedDeltaNetAttention))
    assert gdn.ssm_state.dtype == gdn.conv_state.dtype == torch.bfloat16
    assert gdn.ssm_state[req.slot].isfinite().all()


def test_partial_rotary_equals_hf_mrope_on_text_positions() -> None:
    """The released configs' rotary (mrope sections, interleaved, factor 0.25, head 256):
    with the three position streams equal, ordinary RoPE on the first 64 dims."""
    config = Qwen3_5TextConfig(
        head_dim=256,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    torch.manual_seed(0)
    positions = torch.randint(0, 30_000, (7,))
    q, k = torch.randn(7, 4 * 256), torch.randn(7, 2 * 256)
    cos, sin = Qwen3_5TextRotaryEmbedding(config)(q, positions[None])  # [1, 7, 64]
    q_hf, k_hf = apply_rotary_pos_emb(q.view(1, 7, 4, 256), k.view(1, 7, 2, 256), cos, sin, unsqueeze_dim=2)
    rope = get_rope(256, config)
    assert rope.rotary_dim == 64
    q_ours, k_ours = rope(positions, q, k)
    torch.testing.assert_close(q_ours, q_hf.reshape(7, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ours, k_hf.reshape(7, -1), atol=1e-5, rtol=1e-5)
    # Only the first 64 dims of each head move.
    torch.testing.assert_close(q_ours.view(7, 4, 256)[..., 64:], q.view(7, 4, 256)[..., 64:])
    # The C++ kernel rotates whole heads: enabling it must leave partial RoPE on the torch path.
    enable_cpu_kernels(rope)
    assert rope.cos_sin_cache is None
    torch.testing.assert_close(rope(positions, q.clone(), k.clone())[0], q_ours)


def test_multimodal_checkpoint_layout_loads_the_text_model() -> None:
    """``Qwen3_5ForConditionalGeneration``'s names: the text model under
    model.language_model., vision and MTP weights skipped, config under text_config."""
    text_config = tiny_text_config(LAYER_PATTERNS["LLLF"], tie=True)
    hf = make_hf_model(text_config, seed=3)
    weights = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in hf.state_dict().items()
        if name != "lm_head.weight"  # tied: saved once, as the embedding
    }
    weights["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    weights["mtp.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    config = Qwen3_5Config(text_config=text_config.to_dict(), tie_word_embeddings=True)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    assert get_model_class(config) is Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM(config)
    model.load_weights(weights.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    engine = Engine(model.eval(), "torch")
    req = engine.add(prompt(20, seed=4))
    engine.step([(req, 20)])
    assert_matches_hf(hf, req)


def test_registry_and_load_errors() -> None:
    config = tiny_text_config(LAYER_PATTERNS["FLFL"])
    config.architectures = ["Qwen3_5ForCausalLM"]
    assert get_model_class(config) is Qwen3_5ForCausalLM
    weights = make_hf_model(config).state_dict()
    model = Qwen3_5ForCausalLM(config)
    unknown = {**weights, "model.layers.0.linear_attn.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="no parameter for checkpoint weights.*extra"):
        model.load_weights(unknown.items())
    partial = {n: t for n, t in weights.items() if "in_proj_z" not in n}
    with pytest.raises(ValueError, match=r"lacks weights.*in_proj_qkvz.weight \[z\]"):
        Qwen3_5ForCausalLM(config).load_weights(partial.items())


def test_state_shapes_and_binding() -> None:
    model = Qwen3_5ForCausalLM(tiny_text_config(LAYER_PATTERNS["FLFL"]))
    gdn = [m for m in model.modules() if isinstance(m, GatedDeltaNetAttention)]
    assert [layer.layer_type for layer in model.model.layers] == LAYER_PATTERNS["FLFL"]
    assert len(gdn) == 2 and len([m for m in model.modules() if isinstance(m, Attention)]) == 2
    # conv over q, k and v: 2 * 2 * 16 + 4 * 16 channels, kernel 4 -> 3 columns kept
    assert gdn[0].get_state_shape() == ((128, 3), (4, 16, 16))
    states = [(torch.zeros(3, 128, 3), torch.zeros(3, 4, 16, 16)) for _ in gdn]
    bind_mamba_state(model, states, state_groups=[0, 1])
    assert gdn[1].conv_state is states[1][0] and gdn[1].state_group == 1
    with pytest.raises(ValueError, match="wants states"):
        bind_mamba_state(model, [(torch.zeros(3, 128, 4), torch.zeros(3, 4, 16, 16))] * 2)
    with pytest.raises(ValueError, match="2 Gated DeltaNet layers but 1"):
        bind_mamba_state(model, states[:1])
