#!/usr/bin/env bash
# Chapter 7's CUDA checks (scripts/gpu_check.py): Triton kernels vs the torch
# reference, CUDA graphs vs eager, batch-1 decode latency, batch-256 throughput
# vs HF generate. Skips cleanly (exit 0) on a machine without a CUDA device.
# Bounded to 8 minutes; run from the repository root:  bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device here; skipped"
    exit 0
fi
PYTHONPATH=. timeout 470 "$PY" scripts/gpu_check.py
