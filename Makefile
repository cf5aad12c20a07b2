# Two entry points for a fresh machine: `make demo` (train a small GPT with HSAP context
# parallelism on CPU ranks) and `make test` (the test suite). Both create .venv with the
# CPU build of torch pinned, so no CUDA wheels are downloaded.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0

.PHONY: venv demo test bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[test,plots]" $(TORCH_CPU)
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) pretrain_gpt_hsap.py

test: venv
	$(PY) -m pytest

clean:
	rm -rf $(VENV) *.egg-info runs checkpoints data_cache
