"""One kernel build per instruction set: which variant a process runs, and the AVX2 one tested here too.

``nanoengine.platforms.cpu.kernel_isa`` picks the widest variant the CPU runs
(``avx512`` or ``avx2`` on x86, ``generic`` elsewhere); ``NANOENGINE_CPU_ISA``
caps it, so an AVX-512 machine builds and runs the AVX2 variant. The kernels'
own tests (``test_cpu_fast_paths.py``, ``test_gguf.py``) run on the widest variant in the main
test run; on an AVX-512 machine one test here runs the attention, norm,
RoPE, GEMM and GGUF block tests again in a process capped at AVX2, so both variants are
compared with the torch reference on every CI run. The last test runs the
kernel benchmark (``scripts/bench_kernels.py --quick``) once, so the script
chapter 7's tables come from keeps working; it checks the report, not speeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoengine import _custom_ops
from nanoengine.platforms import cpu as cpu_platform
from nanoengine.platforms.cpu import (
    CPU_ISA_ENV,
    KERNEL_ISA_FLAGS,
    isa_cap_environment,
    kernel_isa,
    supported_kernel_isas,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_isa(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """kernel_isa() read anew under the test's environment, and restored afterwards."""
    kernel_isa.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    kernel_isa.cache_clear()


def test_auto_is_the_widest_variant_this_cpu_runs(fresh_isa: pytest.MonkeyPatch) -> None:
    fresh_isa.delenv(CPU_ISA_ENV, raising=False)
    supported = supported_kernel_isas()
    assert supported[-1] == "generic" and kernel_isa() == supported[0]
    if torch.cpu._is_avx512_supported():
        assert supported[:2] == ("avx512", "avx2")


def test_the_cap_names_the_variant_and_refuses_what_the_cpu_lacks(fresh_isa: pytest.MonkeyPatch) -> None:
    fresh_isa.setenv(CPU_ISA_ENV, "AVX2 ")  # spelling is forgiven: case and spaces
    if "avx2" in supported_kernel_isas():
        assert kernel_isa() == "avx2"
        assert "avx2" in _custom_ops._module_name() and "-march=x86-64-v3" in _custom_ops.compile_flags()
    kernel_isa.cache_clear()
    fresh_isa.setenv(CPU_ISA_ENV, "sse9")
    with pytest.raises(ValueError, match=r"NANOENGINE_CPU_ISA='sse9': expected auto or one of avx512, avx2"):
        kernel_isa()
    kernel_isa.cache_clear()
    fresh_isa.setattr(cpu_platform, "supported_kernel_isas", lambda: ("avx2", "generic"))
    fresh_isa.setenv(CPU_ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="runs only avx2, generic"):
        kernel_isa()


def test_avx2_cap_hides_bf16_dot_products_and_caps_torchs_libraries(fresh_isa: pytest.MonkeyPatch) -> None:
    """Capped at AVX2 a process behaves as an AVX2-only CPU: no bf16 GEMM, dtype "auto" is fp32."""
    fresh_isa.setenv(CPU_ISA_ENV, "avx2")
    cpu_platform.cpu_bf16_features.cache_clear()
    try:
        assert not cpu_platform.cpu_bf16_features().fast_bf16
        assert cpu_platform.default_cpu_dtype() == "float32"
    finally:
        cpu_platform.cpu_bf16_features.cache_clear()
    env = isa_cap_environment("avx2")
    assert env == {
        CPU_ISA_ENV: "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert isa_cap_environment("avx512") == {CPU_ISA_ENV: "avx512"}
    assert set(KERNEL_ISA_FLAGS) == {"avx512", "avx2", "generic"}


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cpu._is_avx512_supported(), reason="the main test run already is the AVX2 variant"
)
def test_avx2_variant_matches_the_torch_reference() -> None:
    """The kernels' tests again, in processes capped at AVX2 (its own build: about a minute).

    The first child checks that the build it loads is the AVX2 one: compiled
    without AVX-512 (``vector_lanes`` is 8: ops.h sizes vectors by ``__AVX512F__``).
    """
    env = {**os.environ, **isa_cap_environment("avx2")}
    check = (
        "from nanoengine.platforms.cpu import kernel_isa; from nanoengine._custom_ops import load_cpu_ops; "
        "print(kernel_isa(), load_cpu_ops().vector_lanes())"
    )
    built = subprocess.run(
        [sys.executable, "-c", check],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.split() == ["avx2", "8"]
    tests = "attention or prefill or decode or rms_norm or rope or silu or packed_linear or gemm"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-o",
        "addopts=",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        str(REPO / "tests" / "test_cpu_fast_paths.py"),
        str(REPO / "tests" / "test_gguf.py"),
        "-k",
        f"{tests} or gguf_kernel",
    ]
    done = subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


@pytest.mark.slow
def test_kernel_benchmark_reports_every_fast_path(tmp_path: Path) -> None:
    """scripts/bench_kernels.py --quick on this process's variant: every kind of fast path is
    timed against its reference, and the JSON names the CPU, the variant and the roofline."""
    out = tmp_path / "kernels.json"
    command = [sys.executable, str(REPO / "scripts" / "bench_kernels.py"), "--quick", "--isa", kernel_isa(),
               "--json", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"== kernel variant {kernel_isa()}" in done.stdout and "CPU:" in done.stdout
    report = json.loads(out.read_text())
    (variant,) = report["variants"]
    assert variant["isa"] == kernel_isa() and variant["peak_gflops"] > 0
    kinds = {row["kind"] for row in variant["rows"]}
    assert kinds == {"prefill attention", "decode attention", "linear qkv", "linear gate_up", "linear down"}
    assert all(row["reference"] > 0 and row.get("fast", row.get("cpu", 1.0)) > 0 for row in variant["rows"])
