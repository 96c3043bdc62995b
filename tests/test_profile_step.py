"""scripts/profile_step.py, the decode-step profile chapter 7 quotes, runs and adds up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_step.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_step", SCRIPT)
    assert spec is not None and spec.loader is not None, f"cannot load {SCRIPT}"
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_step"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_times_every_part_of_full_decode_steps(
    tiny_llama: str, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only steps where every request decodes are kept, each part was seen, and the bytes line is printed."""
    script = _load_script()
    args = script.argparse.Namespace(model=tiny_llama, dtype=dtype, batch=3, context=20, steps=4, quantization=None)
    llm, steps = script.profile(args)
    assert len(steps) >= 2, f"expected several full decode steps, got {len(steps)}"
    for parts in steps:
        for part in ("matmuls", "LM head", "attention", "norms, RoPE, SiLU", "forward", "sampling", "step"):
            assert parts.get(part, 0.0) > 0, f"{part!r} was not timed in a decode step: {parts}"
        assert parts["forward"] < parts["step"], parts
    script.report(args, steps, script.Console())
    script.bytes_per_step(args, llm, script.Console())
    out = capsys.readouterr().out
    assert "the engine" in out and "bytes per step" in out and dtype in out


def test_prefill_profile_times_one_prompt_per_step(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--prefill: each measured step prefills one fresh prompt, its attention and matmuls timed."""
    script = _load_script()
    args = script.argparse.Namespace(model=tiny_llama, dtype="float32", batch=1, context=40, steps=3, prefill=True,
                                     quantization=None)
    _, steps = script.profile_prefill(args)
    assert len(steps) == 3
    for parts in steps:
        for part in ("matmuls", "attention", "forward", "step"):
            assert parts.get(part, 0.0) > 0, f"{part!r} was not timed in a prefill step: {parts}"
    script.report(args, steps, script.Console())
    out = capsys.readouterr().out
    assert "prefill step, one prompt of 40 tokens" in out and "prompt tok/s" in out
