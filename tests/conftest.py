"""Shared fixtures: tiny random models (built once per session) and the real default model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from browser_helpers import Browser
from tiny_models import make_tiny_model_dir

# Keep tokenizers from spawning its own pool.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One torch thread per pytest-xdist worker: `make test` runs two workers on two
# cores, and two threads each (four on two cores) made every forward pass, and
# the ranks and engine processes the tests start, wait for one another. A run
# without workers lets torch use every core.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(os.cpu_count() or 1, 1))
# Without a GPU the Triton kernels run in Triton's interpreter, and the switch must
# be on before anything imports triton.language (transformers may, when it builds
# the tiny models), or Triton's own helper functions get compiled-mode wrappers.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(autouse=True)
def _check_engine_invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine built in a test checks KV cache and scheduler invariants after each step
    (nanoengine/instruments/invariants.py); a broken invariant fails the test that broke it."""
    monkeypatch.setenv("NANOENGINE_CHECK_INVARIANTS", "1")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """tiny_model_factory("qwen3", tie=False) -> path of a ready HF directory (cached)."""
    made: dict[tuple[str, bool], str] = {}

    def make(arch: str = "llama", tie: bool = True) -> str:
        key = (arch, tie)
        if key not in made:
            root = tmp_path_factory.mktemp(f"tiny-{arch}-{'tied' if tie else 'untied'}")
            made[key] = str(make_tiny_model_dir(root, arch, tie=tie))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The converted SmolLM2-135M-Instruct; `make test` prepares it before pytest runs."""
    from nanoengine.transformers_utils.config import resolve_model_path

    return resolve_model_path("SmolLM2-135M-Instruct")


def pytest_configure(config: pytest.Config) -> None:
    """One marker per graded exercise (``-m exercise_4_1``), found from the code's markers."""
    from chapters.exercises import find_exercises

    for exercise in find_exercises().values():
        config.addinivalue_line("markers", f"{exercise.marker}: grading of exercise {exercise.exercise_id}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium, one per test module (the docs site's tests, the live view's)."""
    chromium = Browser()
    yield chromium
    chromium.close()
