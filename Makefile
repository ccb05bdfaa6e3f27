# Two commands for a fresh clone (python3 + make are all you need):
#   make up     run the local gateway stack (4 simulated workers + router + Envoy) on :8080
#   make test   run the checks (ruff, mypy) and the test suite
# Both create .venv and install the project into it on first use.
#   make sglang-cpu   real SGLang 0.5.23 for this CPU (own venv in ~/.cache, ~11 GB once): enables the
#                     real-SGLang tests, `prefix-router up --engine sglang-cpu` and `bench --engine sglang-cpu`

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORKERS ?= 4
PORT ?= 8080

.PHONY: up test check bench install clean sglang-cpu

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# xds-protos bundles an older copy of opentelemetry/proto; whichever installs last wins. Put the real
	# one back so the OTLP exporters import (the router reports a clear error if they cannot).
	$(BIN)/pip install -q --force-reinstall --no-deps "opentelemetry-proto==$$($(BIN)/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
	touch $@

install: $(VENV)/.installed

up: $(VENV)/.installed
	$(BIN)/prefix-router up --workers $(WORKERS) --port $(PORT)

test: check
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Lint, format and types (also the first step of `make test`).
check: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Real SGLang on CPU: reuses ~/.cache/prefix-router/sglang-0.5.23 when it is there (see docs/real-sglang.md).
sglang-cpu: $(VENV)/.installed
	$(BIN)/python -m sglang_workers.real.install --python $(PYTHON)

bench: $(VENV)/.installed
	$(BIN)/prefix-router bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
