# Two entry points for a fresh machine: `make demo` (train a small GPT with HSAP context
# parallelism on CPU ranks) and `make test` (the test suite). Both create .venv with the
# CPU build of torch pinned, so no CUDA wheels are downloaded.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0

.PHONY: venv demo test bench clean venv-bridge test-bridge venv-latest test-latest gpu-bundle

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[test,plots]" $(TORCH_CPU)
	touch $@

venv: $(VENV)/.installed

# ARGS: extra flags for the demo, e.g. make demo ARGS="--train-iters 20" (they override the preset)
demo: venv
	$(PY) pretrain_gpt_hsap.py $(ARGS)

test: venv
	$(PY) -m pytest

# Megatron-Bridge integration (docs/bridge.md): its own environment, because Bridge pins its own
# dependency set. megatron-bridge 0.3.1 is installed without its dependencies (they would pull CUDA
# wheels); the list below is what its CPU path imports.
BRIDGE_VENV := .venv-bridge
BRIDGE_PY := $(BRIDGE_VENV)/bin/python
BRIDGE_DEPS := megatron-core==0.16.1 einops "transformers<5" "huggingface_hub<1.0" "datasets>=2.20" \
	"omegaconf>=2.3" rich "tensorboard>=2.19" nvidia-modelopt "nvidia-resiliency-ext~=0.4.1" "six>=1.17" \
	regex pyyaml tqdm pytest hypothesis pytest-timeout psutil

$(BRIDGE_VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(BRIDGE_VENV)
	$(BRIDGE_PY) -m pip install -q --upgrade pip
	$(BRIDGE_PY) -m pip install -q $(TORCH_CPU)
	$(BRIDGE_PY) -m pip install -q $(TORCH_CPU) $(BRIDGE_DEPS)
	$(BRIDGE_PY) -m pip install -q --no-deps megatron-bridge==0.3.1
	$(BRIDGE_PY) -m pip install -q --no-deps -e .
	touch $@

venv-bridge: $(BRIDGE_VENV)/.installed

test-bridge: venv-bridge
	$(BRIDGE_PY) -m pytest tests/bridge

# What the lent GPU machine lacks (docs/gpu.md): megatron-core and the small pure-Python/abi3 packages
# megatron_hsap needs beyond torch, as Python 3.12 x86-64 wheels unpacked into gpu_bundle/site (put it
# on PYTHONPATH there; no package index is needed).
GPU_BUNDLE := gpu_bundle
GPU_BUNDLE_PACKAGES ?= megatron-core==0.16.1 einops psutil

gpu-bundle:
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)/wheels
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d $(GPU_BUNDLE)/wheels $(GPU_BUNDLE_PACKAGES)
	for wheel in $(GPU_BUNDLE)/wheels/*.whl; do $(PYTHON) -m zipfile -e $$wheel $(GPU_BUNDLE)/site; done
	rm -rf $(GPU_BUNDLE)/wheels
	du -sh $(GPU_BUNDLE)

# The current stack (docs/training.md, "Supported versions"): Python 3.12, megatron-core 0.19.2 (0.17+ needs
# Python 3.12) and the registry's torch for it (a CUDA build, about 4 GB, which runs on CPU with gloo); the
# whole suite. Python 3.12 is pyenv's newest 3.12 or python3.12 on PATH; LATEST_PYTHON=... overrides.
LATEST_VENV := .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
LATEST_STACK := megatron-core==0.19.2 torch==2.14.1
LATEST_PYTHON ?= $(shell for p in $$(ls -d "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python 2>/dev/null \
	| sort -V | tail -1) $$(command -v python3.12); do "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
	2>/dev/null && echo "$$p" && break; done)

$(LATEST_VENV)/.installed: setup.cfg pyproject.toml
	@test -n "$(LATEST_PYTHON)" || { echo "make test-latest needs Python 3.12 (megatron-core 0.17+ requires it) and" \
		"found none: neither pyenv's versions/3.12* nor python3.12 on PATH. Install one (pyenv install 3.12)" \
		"or pass LATEST_PYTHON=/path/to/python3.12" >&2; exit 1; }
	$(LATEST_PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install -q --upgrade pip
	$(LATEST_PY) -m pip install -q $(LATEST_STACK) -e ".[test,plots]"
	touch $@

venv-latest: $(LATEST_VENV)/.installed

test-latest: venv-latest
	$(LATEST_PY) -m pytest

clean:
	rm -rf $(VENV) $(BRIDGE_VENV) $(LATEST_VENV) $(GPU_BUNDLE) *.egg-info runs checkpoints data_cache
