"""Tests for model name resolution (nanoengine/transformers_utils/config.py).

Everything runs on temporary folders and tiny hand-made configs/tokenizers, so the
tests pass without the converted SmolLM2 and never touch the network.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, PreTrainedTokenizerFast

from nanoengine.transformers_utils import config as cfg
from nanoengine.transformers_utils.config import (
    CACHE_ENV_VAR,
    DEFAULT_MODEL,
    PREPARED_MARKER,
    default_cache_dir,
    get_hf_config,
    get_tokenizer,
    prepared_model_dir,
    resolve_model_path,
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty nanoengine cache folder that default_cache_dir() points at."""
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    return root


def make_model_dir(path: Path, *, marker: bool = False) -> Path:
    """A minimal model folder: a config.json (and the prepare marker if asked)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if marker:
        (path / PREPARED_MARKER).write_text("{}")
    return path


# --- cache folder ---------------------------------------------------------------------


def test_cache_dir_follows_env_var(cache: Path) -> None:
    assert default_cache_dir() == cache
    assert prepared_model_dir() == cache / "models" / DEFAULT_MODEL


def test_cache_dir_defaults_to_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_ENV_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "nanoengine"


def test_explicit_cache_dir_wins(cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    assert prepared_model_dir(DEFAULT_MODEL, other) == other / "models" / DEFAULT_MODEL


def test_prepared_model_dir_rejects_unknown_name(cache: Path) -> None:
    with pytest.raises(ValueError, match="'gpt-17'"):
        prepared_model_dir("gpt-17")


# --- step 1: known, prepared models -----------------------------------------------


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_known_name_resolves_to_prepared_dir(cache: Path, name: str) -> None:
    model_dir = make_model_dir(cache / "models" / "SmolLM2-135M-Instruct", marker=True)
    assert resolve_model_path(name) == str(model_dir)


def test_known_name_not_prepared_says_how_to_prepare(cache: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model_path(DEFAULT_MODEL)
    message = str(info.value)
    assert repr(DEFAULT_MODEL) in message
    assert "scripts/prepare_model.py" in message and "make model" in message
    assert str(cache) in message
    with pytest.raises(ValueError, match="Run `python scripts/prepare_model.py gemma-3-270m` once"):
        resolve_model_path("gemma-3-270m")  # the second model is prepared only when asked


def test_folder_without_marker_counts_as_not_prepared(cache: Path) -> None:
    # A crash mid-prepare must not leave a folder the engine would half-load.
    make_model_dir(cache / "models" / DEFAULT_MODEL, marker=False)
    with pytest.raises(ValueError, match="not prepared"):
        resolve_model_path(DEFAULT_MODEL)


# --- step 2: local directories ------------------------------------------------------


def test_local_dir_resolves_to_itself(cache: Path, tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path / "my-model")
    assert resolve_model_path(str(model_dir)) == str(model_dir)


def test_relative_local_dir_becomes_absolute(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = make_model_dir(tmp_path / "rel-model")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("rel-model") == str(model_dir)


def test_local_dir_without_config_is_rejected(cache: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json") as info:
        resolve_model_path(str(empty))
    assert str(empty) in str(info.value)


def test_local_file_is_rejected(cache: Path, tmp_path: Path) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model_path(str(file))


# --- step 3: the hub --------------------------------------------------------------


def test_unknown_name_offline_fails_fast_naming_the_value(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(ValueError) as info:
        resolve_model_path("no-such-org/no-such-model")
    assert time.perf_counter() - started < 10
    message = str(info.value)
    assert message.startswith("Unknown model 'no-such-org/no-such-model'")
    assert "HF_HUB_OFFLINE" in message and DEFAULT_MODEL in message


def test_hub_failure_reason_is_reported(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def failing_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        raise ConnectionError("name resolution failed")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(cfg, "snapshot_download", failing_download)
    with pytest.raises(
        ValueError, match="could not be fetched from the hub: ConnectionError: name resolution"
    ):
        resolve_model_path("some-org/some-model")
    (call,) = calls
    assert call["repo_id"] == "some-org/some-model"
    assert call["local_files_only"] is False
    assert call["etag_timeout"] <= 10  # fail fast when offline


def test_hub_success_returns_snapshot_path(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = make_model_dir(tmp_path / "snapshot")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(cfg, "snapshot_download", lambda repo_id, **kwargs: str(snapshot))
    assert resolve_model_path("some-org/some-model") == str(snapshot)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_non_string_or_empty_model_is_rejected(bad: Any) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        resolve_model_path(bad)


# --- config and tokenizer loading ---------------------------------------------------


def test_get_hf_config_reads_local_dir(tmp_path: Path) -> None:
    tiny = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100
    )
    tiny.save_pretrained(tmp_path)
    loaded = get_hf_config(str(tmp_path))
    assert loaded.model_type == "llama"
    assert (loaded.hidden_size, loaded.num_key_value_heads, loaded.vocab_size) == (64, 2, 100)


def test_get_tokenizer_loads_fast_tokenizer(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    tokenizer = get_tokenizer(str(tmp_path))
    assert tokenizer.is_fast
    assert tokenizer("hello world bogus")["input_ids"] == [1, 2, 0]
