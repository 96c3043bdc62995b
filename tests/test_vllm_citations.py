"""Every ``vllm/...`` path the project cites exists in vLLM 0.32.0.

Module docstrings name their vLLM 0.32 counterpart, and the chapters walk from
our files to vLLM's (chapter 5's source map). A cited path that 0.32 does not
have sends the reader nowhere, so each one written in backticks in the
package, the walkthroughs, the scripts and the docs is checked against
``tests/data/vllm-0.32.0-paths.txt``: every Python file of an installed vLLM
0.32.0, written by ``scripts/list_vllm_paths.py``. A folder (with or
without a trailing ``/``) must hold one of those files. (Paths under ``csrc/``
are not in vLLM's wheel and are not checked.)
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PATHS = ROOT / "tests" / "data" / "vllm-0.32.0-paths.txt"
# A path in code formatting: right after a backtick, up to the first character
# no path has (a closing backtick, a space, a colon before a line number).
CITED = re.compile(r"`(vllm/[\w./-]*)")
SOURCES = ("nanoengine/**/*.py", "chapters/**/*.py", "scripts/*.py", "docs/**/*.md", "README.md")


def known_paths() -> tuple[set[str], set[str]]:
    """(files, folders) of vLLM 0.32.0, folders with a trailing slash."""
    files = set(VLLM_PATHS.read_text(encoding="utf-8").split())
    folders = {
        f"{'/'.join(parts[:i])}/" for parts in (f.split("/") for f in files) for i in range(1, len(parts))
    }
    return files, folders


def citations() -> dict[str, list[str]]:
    """Cited path -> the files (relative to the repository) that cite it."""
    found: dict[str, list[str]] = {}
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            for cited in CITED.findall(path.read_text(encoding="utf-8")):
                found.setdefault(cited.rstrip("."), []).append(path.relative_to(ROOT).as_posix())
    return found


def test_the_path_list_is_vllm_0_32() -> None:
    files, _ = known_paths()
    assert len(files) > 2000, "the list looks truncated: regenerate it with scripts/list_vllm_paths.py"
    for landmark in ("vllm/v1/core/sched/scheduler.py", "vllm/v1/engine/core.py", "vllm/entrypoints/llm.py"):
        assert landmark in files


def test_every_cited_vllm_path_exists_in_0_32() -> None:
    files, folders = known_paths()
    cited = citations()
    assert len(cited) > 50, "the scan found too few citations: has the pattern stopped matching?"
    missing = {
        path: where
        for path, where in cited.items()
        if path not in files and path not in folders and f"{path}/" not in folders
    }
    assert not missing, "vLLM 0.32.0 has no such path:\n" + "\n".join(
        f"  {path}  (cited in {', '.join(sorted(set(where)))})" for path, where in sorted(missing.items())
    )
