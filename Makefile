# Two commands set everything up on a fresh machine:
#   make run    creates .venv, installs specdec, runs `python -m specdec.run` (default model and suite)
#   make test   creates .venv, installs specdec with its test tools, runs the test suite
# Pass Hydra overrides to `make run` with ARGS='strategies=[greedy,hf_generate] data.limit=5'.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch lies on this project's machines; with a GPU, set TORCH=torch (or preinstall yours).
TORCH ?= torch==2.13.0
ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.specdec-installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[dev]"
	touch $(STAMP)

.PHONY: install run test lint
install: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m specdec.run $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check specdec heads tests
