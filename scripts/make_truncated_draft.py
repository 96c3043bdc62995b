"""Make a cheap draft model for chapter 9: SmolLM2's first N layers, nothing else.

This is NOT a trained draft model. vLLM users pair a target with a small model
trained on the same data (or an EAGLE head trained on the target's hidden
states); no such model can be downloaded here. Cutting a model after its first
N decoder layers keeps its tokenizer, embeddings, final norm and head, so it
speaks the same vocabulary and runs N/30 of the cost -- and guesses worse than
a real draft would. Chapter 9 uses it to show the mechanism and its cost, and
labels its figures "layer-truncated SmolLM2".

The folder it writes is a plain HF folder (config.json with
``num_hidden_layers = N``, model.safetensors with those layers' weights, the
tokenizer files), usable as ``speculative_config={"method": "draft_model",
"model": FOLDER}``.

Usage: ``python scripts/make_truncated_draft.py [--layers N] [--source MODEL] [--out DIR]``
(default: 8 layers of the prepared SmolLM2-135M-Instruct, written next to it).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from nanoengine.transformers_utils.config import resolve_model_path

# Checkpoint names of one decoder layer: model.layers.<index>.<...>
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def truncate(source: Path, out: Path, num_layers: int) -> Path:
    """Write the first ``num_layers`` layers of the model in ``source`` to ``out``."""
    config = json.loads((source / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"--layers must be between 1 and {total - 1} for {source}, got {num_layers}.")
    weights = load_file(source / "model.safetensors")
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if (match := _LAYER_NAME.match(name)) is None or int(match.group(1)) < num_layers
    }
    out.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, out / "model.safetensors")
    # Everything but the weights and config (tokenizer, chat template, generation config).
    for item in source.iterdir():
        if item.is_file() and item.name not in ("config.json", "model.safetensors") and not item.name.startswith("."):
            shutil.copy2(item, out / item.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers to keep (default 8 of 30)")
    parser.add_argument("--source", default="SmolLM2-135M-Instruct", help="the model to cut (a name or a folder)")
    parser.add_argument("--out", default=None, help="folder to write (default: next to the source)")
    args = parser.parse_args()
    source = Path(resolve_model_path(args.source))
    out = Path(args.out) if args.out else source.with_name(f"{source.name}-first{args.layers}layers")
    print(f"[make_truncated_draft] {truncate(source, out, args.layers)} (layer-truncated, not a trained draft)")


if __name__ == "__main__":
    main()
