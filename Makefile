# Two entry points: `make demo` and `make test`. Each sets itself up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint

$(BIN)/python:
	$(PY) -m venv $(VENV)

# CPU torch first (a file on disk here), so the package's torch>= requirement
# is already met and pip never pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
