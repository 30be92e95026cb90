# `make test` and `make demo` each build their own virtualenv from nothing but a Python >= 3.10.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP_FLAGS ?= --quiet --disable-pip-version-check

.PHONY: test lint typecheck unit test-matrix route-matrix bench demo clean

# The C extensions (spanprof._labels._cproxy, spanprof._profiling._samplers._alloc,
# spanprof._profiling._encoders._wire) are built by the editable install: rebuild when one changes.
$(BIN)/.installed: pyproject.toml middleware/spanprof/_labels/_cproxy.c \
		middleware/spanprof/_profiling/_samplers/_alloc.c \
		middleware/spanprof/_profiling/_encoders/_wire.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_FLAGS) --upgrade pip
	$(BIN)/pip install $(PIP_FLAGS) -e '.[dev,demo]'
	touch $@

lint: $(BIN)/.installed
	$(BIN)/ruff check middleware tests benchmarks sample_app tools
	$(BIN)/ruff format --check middleware tests benchmarks sample_app tools

typecheck: $(BIN)/.installed
	$(BIN)/mypy

unit: $(BIN)/.installed
	$(BIN)/pytest -q -p no:cacheprovider

# The label engine leans on CPython internals that move between versions: run its tests on every
# CPython >= 3.10 that pyenv, PATH or the chroot offers, each in its own virtualenv, and the
# whole suite on 3.14 and 3.15 (docs/testing.md).
test-matrix: $(BIN)/.installed
	$(BIN)/python tools/test_matrix.py

# Route naming leans on Starlette's and FastAPI's routing internals: run its tests on the oldest
# and newest releases pyproject.toml allows, each in its own virtualenv (~1 min cold, ~6 s warm).
route-matrix: $(BIN)/.installed
	$(BIN)/python tools/route_matrix.py

test: lint typecheck unit test-matrix route-matrix

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.run --write docs/benchmarks.md

demo: $(BIN)/.installed
	$(BIN)/python -m sample_app.demo

clean:
	rm -rf $(VENV) .venv-* .mypy_cache .ruff_cache .pytest_cache
