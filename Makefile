# Two entry points: `make serve` and `make test`. Both build .venv from scratch when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint gpu-test bench clean tools

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build that the CI machines carry on local disk.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The whole service: 1 prefill + 1 decode worker, OpenAI API on :8000, metrics on :8080. The model is the trained
# dsv4-mini-py (models/, training/) when the tree has it, else the built-in random tiny model. Try:
#   curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
#   -d '{"model": "dsv4", "prompt": "def fibonacci(n):", "max_tokens": 32}'
SERVE_MODEL := $(if $(wildcard models/dsv4-mini-py/config.json),--model models/dsv4-mini-py)
serve: $(STAMP)
	$(VENV)/bin/dsv4 serve $(SERVE_MODEL)

test: $(STAMP)
	$(PY) -m pytest -x -q tests

# Lint and types (.ci/run runs it beside the tests): ruff's rules and its formatter's check over the product
# packages, tests/ and benchmarks/, then mypy over the product packages (both configured in pyproject.toml).
LINT_PATHS := dsv4_kernels engine kv_transfer prefill_worker decode_worker router service tests benchmarks training
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

# On a CUDA machine: every test marked `gpu` and the Triton kernels compiled (pytest -m "gpu or triton").
gpu-test:
	tools/gpu/run_tests.sh

# Debian tools the deploy tests run (promtool, prometheus); needs apt-get as root, else those tests skip.
tools:
	@if command -v promtool >/dev/null && command -v prometheus >/dev/null; then \
		echo "tools: $$(promtool --version 2>&1 | head -n 1)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -q && apt-get install -y -q --no-install-recommends prometheus; \
	else \
		echo "tools: cannot install Debian's prometheus (needs apt-get as root)" >&2; exit 1; \
	fi

bench: $(STAMP)
	$(PY) scripts/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info

# A CUDA machine (Python 3.12, Linux): the torch the Hopper kernel wheels import on (2.11) and those wheels, pinned
# together in the `gpu` extra, then `dsv4 doctor` to show which fast paths load. WHEELS=dir installs from carried
# wheels only (a machine without network: pip --no-index --find-links dir).
.PHONY: install-gpu
install-gpu:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) 'torch==2.11.*'
	$(PY) -m pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) -e '.[gpu]'
	$(VENV)/bin/dsv4 doctor
