# Two entry points: `make serve` and `make test`. Both build .venv from scratch when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build that the CI machines carry on local disk.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The whole service on the built-in tiny model: 1 prefill + 1 decode worker, OpenAI API on :8000,
# metrics on :8080. Try: curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
#   -d '{"model": "dsv4", "prompt": "Hello", "max_tokens": 16}'
serve: $(STAMP)
	$(VENV)/bin/dsv4 serve

test: $(STAMP)
	$(PY) -m pytest -x -q tests

bench: $(STAMP)
	$(PY) scripts/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info
