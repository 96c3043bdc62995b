"""Which GGUF file ``LLM(...)`` loads, and the Hugging Face folder (config, tokenizer) beside it.

Chapter 6 (``LLM(...)`` construction). vLLM 0.32 counterpart: none (0.32
reads no GGUF file); earlier releases accepted a ``.gguf`` path as the model
and read the config from the file, as this module does.

Two ways to ask for GGUF weights:

* ``LLM("path/model.gguf")``: the file itself. Its folder gives the config
  and tokenizer when it holds them (``config.json`` beside the file);
  otherwise they are read from the GGUF's metadata once, with transformers,
  and kept in ``<cache>/gguf/<name>-<fingerprint>/``, so later runs start at
  once (a large vocabulary takes a minute or more to convert).
* ``LLM(folder, quantization="gguf")``: a Hugging Face folder holding one
  ``.gguf`` beside its ``config.json`` -- ``scripts/prepare_model.py`` keeps
  SmolLM2's that way, so the default model runs either way. A folder whose
  only weights are one ``.gguf`` (the prepared ``gemma-3-270m``) needs no
  flag: ``quantization="gguf"`` is inferred, as vLLM infers it from a path.

Either way ``quantization="gguf"`` is what the engine records.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from nanoengine.model_executor.layers.quantization import QUANTIZATION_METHODS
from nanoengine.transformers_utils.config import default_cache_dir, resolve_model_path

GGUF_SUFFIX = ".gguf"


def resolve_weights(model: str, quantization: str | None, load_format: str) -> tuple[str, str | None]:
    """(the model folder, the GGUF file to read the weights from, or None for the folder's safetensors)."""
    if quantization not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {quantization!r}.")
    if not is_gguf_path(model) and quantization is None:
        folder = resolve_model_path(model, load_format)
        only_gguf = load_format == "auto" and not any(Path(folder).glob("*.safetensors"))
        if only_gguf and len(list(Path(folder).glob(f"*{GGUF_SUFFIX}"))) == 1:
            return folder, str(gguf_in_folder(folder))  # its weights are the GGUF: quantization="gguf"
        return folder, None
    if load_format != "auto":
        raise ValueError(f"load_format={load_format!r} reads no weights; a GGUF model is its weights "
                         "(use load_format='auto').")
    if is_gguf_path(model):
        gguf = Path(model).expanduser()
        return gguf_model_folder(gguf), str(gguf)
    folder = resolve_model_path(model, load_format)
    return folder, str(gguf_in_folder(folder))


def is_gguf_path(model: str) -> bool:
    """``model`` names a GGUF file (by its suffix; it need not exist yet to be meant as one)."""
    return model.lower().endswith(GGUF_SUFFIX)


def gguf_in_folder(folder: str) -> Path:
    """The one ``.gguf`` file of a model folder (``quantization="gguf"`` on a folder)."""
    found = sorted(Path(folder).glob(f"*{GGUF_SUFFIX}"))
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(f.name for f in found)})"
        raise ValueError(f"quantization='gguf' needs exactly one .gguf file in {folder}; it holds {what}. "
                         "Pass the file itself as the model to choose one.")
    return found[0]


def gguf_model_folder(gguf: Path) -> str:
    """A folder with the config and tokenizer of ``gguf``: its own, or one made from its metadata."""
    if not gguf.is_file():
        raise ValueError(f"GGUF file {str(gguf)!r} does not exist.")
    if (gguf.parent / "config.json").is_file():
        return str(gguf.parent)
    stat = gguf.stat()
    fingerprint = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    folder = default_cache_dir() / "gguf" / f"{gguf.stem}-{fingerprint}"
    if not (folder / "config.json").is_file():
        staging = folder.with_name(folder.name + ".partial")
        save_config_and_tokenizer(gguf, staging)
        staging.rename(folder)  # whole, or not at all
    return str(folder)


def save_config_and_tokenizer(gguf: Path, folder: Path) -> Any:
    """Read the config and the tokenizer out of the GGUF's metadata (transformers does it) and save
    them into ``folder``; returns the tokenizer, or None for a file that carries none.

    ``scripts/prepare_model.py`` prepares Gemma 3 270M's folder with it too.
    """
    from transformers import AutoConfig, AutoTokenizer

    from nanoengine.model_executor.model_loader.gguf_loader import ARCHITECTURES, GGUFCheckpoint

    checkpoint = GGUFCheckpoint(gguf)  # refuses an unsupported architecture before the slow part
    folder.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the engine is told by quantization="gguf", not by the config
    config.architectures = [ARCHITECTURES[checkpoint.architecture]]  # GGUF metadata names no class
    config.save_pretrained(folder)
    if "tokenizer.ggml.model" not in checkpoint.reader.fields:  # a file may carry no tokenizer (skip_tokenizer_init)
        return None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF gives no length limit, so transformers would fall back to "infinite".
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(folder)
    return tokenizer
