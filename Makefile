# The README's two commands: `make demo` (train the default model) and `make test` (the whole suite).
# Both create or reuse .venv through scripts/install.sh, the same install path CI and Docker use.
SHELL := /bin/bash
VENV ?= .venv
BIN := $(VENV)/bin
# Everything a run writes stays inside the project (temp files, JIT-built ops, torch.compile's kernels, wandb caches).
export TMPDIR := $(CURDIR)/.tmp
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.torch_extensions
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.torchinductor
export WANDB_MODE ?= offline
export WANDB_DIR := $(CURDIR)/runs
export WANDB_CACHE_DIR := $(CURDIR)/.tmp/wandb-cache
export WANDB_CONFIG_DIR := $(CURDIR)/.tmp/wandb-config
export WANDB_SILENT := true
export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1
export OMP_NUM_THREADS ?= 1

NPROC ?= 2
DEMO_DATA ?= data/default
DEMO_RUN ?= configs/runs/demo.yaml
DEMO_OUT ?= runs/demo
# Appended to the demo's prepare and train commands (tests/test_doc_commands.py scales the demo down with them).
PREPARE_ARGS ?=
DEMO_ARGS ?=

.PHONY: venv demo test lint clean image test-image

venv:
	@mkdir -p $(TMPDIR) $(TORCH_EXTENSIONS_DIR)
	@scripts/install.sh $(VENV) dev

demo: venv
	$(BIN)/dist-trainer prepare --out $(DEMO_DATA) --vocab-size 4096 --max-bytes 12000000 $(PREPARE_ARGS)
	$(BIN)/dist-trainer-torchrun --standalone --nproc_per_node $(NPROC) -m dist_trainer.cli train --config $(DEMO_RUN) \
		--data.path=$(DEMO_DATA) --train.out_dir=$(DEMO_OUT) $(DEMO_ARGS)
	$(BIN)/dist-trainer generate --checkpoint $(DEMO_OUT) --prompt "def main(" --max-new-tokens 80

# -m "not image": tests/test_image.py builds and runs the Docker images (minutes, root); CI runs it after the suite
# (.ci/run: make test-image). A later -m in PYTEST_ARGS overrides it.
# TEST_WORKERS pytest-xdist workers (0: one process); --dist loadfile keeps each test module on one worker (its
# module-scoped spawns run once), handed out longest first (tests/conftest.py: LONGEST_FIRST).
TEST_WORKERS ?= 2
test: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -m "not image" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The CPU image (docker/Dockerfile.cpu) without a Docker daemon or registry: buildah on a local Debian base, cached
# in .image/; prints its size. `scripts/build_image.sh cuda` builds docker/Dockerfile without its CUDA parts.
image:
	@mkdir -p $(TMPDIR)
	scripts/build_image.sh cpu

test-image: venv
	$(BIN)/python -m pytest -q -m image tests/test_image.py

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf runs .tmp .pytest_cache
