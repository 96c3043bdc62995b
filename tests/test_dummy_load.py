"""load_format="dummy", skip_tokenizer_init and the built-in Qwen3.5-0.8B config (chapter 6).

Dummy weights: a tiny Llama folder holding only config.json and a tokenizer
builds the same model a real checkpoint does, filled with seeded values in
[-1e-3, 1e-3]; real weights in the folder are ignored. skip_tokenizer_init: an
engine without a tokenizer generates the same token ids from token-id prompts
and refuses text. Qwen/Qwen3.5-0.8B: offline, with load_format="dummy", it
resolves to the config nanoengine ships (never built at full size here).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
import torch
from test_attention_ref import allocate_blocks, make_attn_metadata
from tiny_models import tiny_config, train_tokenizer
from torch import nn

from nanoengine import LLM, SamplingParams
from nanoengine.attention.layer import Attention, bind_kv_cache
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.entrypoints.openai.api_server import make_arg_parser, run_server
from nanoengine.model_executor.model_loader import get_model
from nanoengine.model_executor.model_loader.weight_utils import DUMMY_WEIGHT_HIGH, DUMMY_WEIGHT_LOW
from nanoengine.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM
from nanoengine.model_executor.models.registry import get_model_class
from nanoengine.transformers_utils.config import (
    CACHE_ENV_VAR,
    get_hf_config,
    get_tokenizer,
    resolve_model_path,
)
from nanoengine.transformers_utils.dummy_configs import DUMMY_CONFIG_SUBDIR

QWEN = "Qwen/Qwen3.5-0.8B"
CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPT = [5, 17, 42, 99, 7, 63, 120]
# Small engines: an explicit block count skips the memory-based sizing.
ENGINE_KWARGS = {"block_size": 16, "max_model_len": 256, "num_gpu_blocks_override": 32}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def weightless_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama folder with config.json and the tokenizer, and no weights."""
    path = tmp_path_factory.mktemp("weightless-llama")
    tokenizer = train_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer))
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.architectures = ["LlamaForCausalLM"]  # what saving a model would have written
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty nanoengine cache, and no hub: what this machine has."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # An empty HF cache too, whatever this machine's holds (read at call time).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    return tmp_path / "cache"


def load(path: str, load_format: str, seed: int = 0) -> nn.Module:
    model = get_model(path, get_hf_config(path), torch.float32, CPU, "torch", load_format, seed)
    assert isinstance(model, nn.Module)
    return model


@torch.no_grad()
def prefill_logits(model: nn.Module) -> torch.Tensor:
    """The logits of one prefill of PROMPT over a fresh paged KV cache."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, layers[0].num_kv_heads, layers[0].head_dim)
    bind_kv_cache(model, [torch.zeros(shape) for _ in layers])
    blocks = allocate_blocks([len(PROMPT)], BLOCK_SIZE, NUM_BLOCKS)
    metadata = make_attn_metadata([0], [len(PROMPT)], blocks, BLOCK_SIZE)
    hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), metadata)
    return model.compute_logits(hidden)


def state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, param.detach().clone()) for name, param in model.named_parameters())


def assert_all_filled(model: nn.Module) -> None:
    """Every parameter drawn from the dummy range: inside it, and not one repeated value."""
    for name, param in model.named_parameters():
        assert param.min() >= DUMMY_WEIGHT_LOW and param.max() <= DUMMY_WEIGHT_HIGH, name
        assert param.numel() == 1 or param.std() > 1e-4, f"{name} was not filled"


# --- dummy weights ------------------------------------------------------------------


def test_dummy_weights_build_the_checkpoints_shapes_without_its_file(
    weightless_llama: str, tiny_llama: str
) -> None:
    with pytest.raises(FileNotFoundError, match="No \\*.safetensors"):
        load(weightless_llama, "auto")
    dummy = load(weightless_llama, "dummy")
    real = load(tiny_llama, "auto")  # the same tiny config, with real weights
    assert {n: (p.shape, p.dtype) for n, p in dummy.named_parameters()} == {
        n: (p.shape, p.dtype) for n, p in real.named_parameters()
    }
    assert_all_filled(dummy)
    logits = prefill_logits(dummy)
    assert logits.shape == (len(PROMPT), dummy.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_dummy_weights_follow_the_seed(weightless_llama: str) -> None:
    first, again, other = (dict(state(load(weightless_llama, "dummy", seed))) for seed in (0, 0, 1))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert all(not torch.equal(first[name], other[name]) for name in first)
    # One generator walks the parameters: two of one shape are not copies.
    assert not torch.equal(first["model.layers.0.mlp.down_proj.weight"], first["model.layers.1.mlp.down_proj.weight"])


def test_dummy_ignores_the_weights_in_the_folder(weightless_llama: str, tiny_llama: str) -> None:
    dummy_over_real = load(tiny_llama, "dummy")
    weightless = dict(state(load(weightless_llama, "dummy")))
    # The values depend on the seed alone, not on the checkpoint beside the config.
    assert all(torch.equal(param, weightless[name]) for name, param in state(dummy_over_real))
    real_logits = prefill_logits(load(tiny_llama, "auto"))
    dummy_logits = prefill_logits(dummy_over_real)
    assert (real_logits - dummy_logits).abs().max() > 1.0


def test_unknown_load_format_is_refused(weightless_llama: str) -> None:
    with pytest.raises(ValueError, match="load_format must be one of"):
        load(weightless_llama, "safetensors")
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineArgs(model=weightless_llama, load_format="pt").create_engine_config()  # type: ignore[arg-type]


def test_engine_args_carry_both_settings_from_the_command_line(weightless_llama: str) -> None:
    parser = make_arg_parser()
    args = parser.parse_args([weightless_llama, "--load-format", "dummy", "--skip-tokenizer-init"])
    model_config = EngineArgs.from_cli_args(args).create_engine_config().model_config
    assert (model_config.load_format, model_config.skip_tokenizer_init) == ("dummy", True)
    defaults = EngineArgs.from_cli_args(parser.parse_args([weightless_llama]))
    assert (defaults.load_format, defaults.skip_tokenizer_init) == ("auto", False)


def test_the_server_refuses_skip_tokenizer_init(weightless_llama: str) -> None:
    args = make_arg_parser().parse_args([weightless_llama, "--skip-tokenizer-init"])
    with pytest.raises(ValueError, match="nanoengine serve needs a tokenizer"):
        run_server(args)


# --- skip_tokenizer_init ------------------------------------------------------------


def test_skip_tokenizer_init_generates_token_ids_and_no_text(tiny_llama: str) -> None:
    with_tokenizer = LLM(tiny_llama, **ENGINE_KWARGS)
    expected = with_tokenizer.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0]
    with_tokenizer.llm_engine.shutdown()
    assert expected.text  # the tokenizer engine does make text

    llm = LLM(tiny_llama, skip_tokenizer_init=True, **ENGINE_KWARGS)
    assert llm.get_tokenizer() is None
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == expected.token_ids and completion.text == ""
    assert out.prompt is None and out.prompt_token_ids == PROMPT
    assert completion.logprobs is not None
    assert all(entry.decoded_token is None for row in completion.logprobs for entry in row.values())
    llm.llm_engine.shutdown()


def test_skip_tokenizer_init_refuses_what_needs_text(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, skip_tokenizer_init=True, **ENGINE_KWARGS)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        llm.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True; use stop_token_ids"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(stop=["."]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.shutdown()


def test_a_folder_without_tokenizer_names_skip_tokenizer_init(tiny_llama: str, tmp_path: Path) -> None:
    """Config and weights only: refused without the setting; with it, EOS comes
    from config.json (there is no generation_config.json either)."""
    shutil.copy(Path(tiny_llama) / "config.json", tmp_path)
    shutil.copy(Path(tiny_llama) / "model.safetensors", tmp_path)
    with pytest.raises(ValueError, match="has no tokenizer.*skip_tokenizer_init=True"):
        LLM(str(tmp_path), **ENGINE_KWARGS)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **ENGINE_KWARGS)
    eos = json.loads((tmp_path / "config.json").read_text())["eos_token_id"]
    assert llm.llm_engine.input_processor.eos_token_ids == [eos]
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 0 and out.text == ""
    llm.llm_engine.shutdown()


# --- the built-in Qwen3.5-0.8B config ------------------------------------------------


def test_qwen3_5_resolves_to_the_built_in_config_under_dummy_only(
    offline_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="Unknown model 'Qwen/Qwen3.5-0.8B'"):
        resolve_model_path(QWEN)  # "auto" needs the checkpoint
    with caplog.at_level(logging.WARNING, logger="nanoengine.transformers_utils.dummy_configs"):
        path = resolve_model_path(QWEN, "dummy")
    assert Path(path) == offline_cache / DUMMY_CONFIG_SUBDIR / "Qwen3.5-0.8B"
    assert [p.name for p in Path(path).iterdir()] == ["config.json"]
    assert "Assumed values" in caplog.text and "linear_num_value_heads=16" in caplog.text

    config = get_hf_config(path)
    assert config.model_type == "qwen3_5_text" and config.architectures == ["Qwen3_5ForCausalLM"]
    stated = {
        "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "intermediate_size": 3584, "vocab_size": 248320, "max_position_embeddings": 262144,
    }
    assert {key: getattr(config, key) for key in stated} == stated
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 6
    assert config.rope_parameters["rope_theta"] == 10_000_000
    assert get_model_class(config) is Qwen3_5ForCausalLM
    with pytest.raises(ValueError, match="has no tokenizer.*skip_tokenizer_init=True"):
        get_tokenizer(path)


def test_unknown_name_under_dummy_lists_the_built_in_configs(offline_cache: Path) -> None:
    with pytest.raises(ValueError, match="ships none for 'some-org/unknown'; built-in configs: Qwen/Qwen3-0.6B, Qwen/Qwen3.5-0.8B"):
        resolve_model_path("some-org/unknown", "dummy")


def test_qwen3_5_engine_config_without_weights_or_tokenizer(offline_cache: Path) -> None:
    engine_config = EngineArgs(model=QWEN, load_format="dummy", skip_tokenizer_init=True).create_engine_config()
    model_config = engine_config.model_config
    assert model_config.load_format == "dummy" and model_config.skip_tokenizer_init
    assert model_config.max_model_len == 262144 and model_config.vocab_size == 248320


def test_qwen3_5_dummy_model_at_reduced_size_fills_every_parameter(offline_cache: Path) -> None:
    """4 of the 24 layers (3 Gated DeltaNet + 1 attention) and a 1,024-token vocabulary."""
    path = resolve_model_path(QWEN, "dummy")
    config = get_hf_config(path)
    config.num_hidden_layers, config.layer_types, config.vocab_size = 4, config.layer_types[:4], 1024
    model = get_model(path, config, torch.float32, CPU, "torch", "dummy", seed=0)
    assert isinstance(model, nn.Module)
    assert_all_filled(model)
    # The assumed Gated DeltaNet heads set these shapes: q, k (16 x 128 each), v and z (16 x 128 each).
    params = dict(model.named_parameters())
    assert params["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (4 * 16 * 128, 1024)
    assert params["model.layers.3.self_attn.qkv_proj.weight"].shape == ((2 * 8 + 2 * 2) * 256, 1024)
