# Quick start: `make demo` then `make test`. Both build the venv from scratch when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# The bundled reference model (models/pystd-moe-29m) and its int8 expert store.
DEMO_MODEL ?= models/pystd-moe-29m
DEMO_STORE ?= .cache/pystd-moe-29m-int8
DEMO_BUDGET ?= 4MiB

.PHONY: venv test lint demo clean

# pip stays quiet (-q), so each step says what it installs: the whole install takes minutes.
$(VENV)/.installed: pyproject.toml
	@echo "creating $(VENV)"
	python3 -m venv $(VENV)
	@echo "installing pip (upgrade)"
	$(PY) -m pip install -q --upgrade pip
	@echo "installing $(TORCH_PIN) (the largest download: a few minutes)"
	$(PY) -m pip install -q "$(TORCH_PIN)"
	@echo "installing moestream and its extras: test (transformers, pytest, ruff...), plot, serve"
	$(PY) -m pip install -q -e ".[test,plot,serve]"
	touch $@
	@echo "installed into $(VENV); the native CPU kernels build on first use (~1 min, said then)"

venv: $(VENV)/.installed

lint: venv
	$(PY) -m ruff check moestream tests benchmarks scripts
	$(PY) -m ruff format --check moestream tests benchmarks scripts

test: venv lint
	$(PY) -m pytest -q

$(DEMO_STORE)/manifest.json: | venv
	@echo "converting $(DEMO_MODEL) into $(DEMO_STORE) (int8 experts)"
	$(PY) -m moestream convert $(DEMO_MODEL) $(DEMO_STORE) --quant int8

# Experts stay on disk; a 4 MiB cache holds ~15% of them and streams the rest.
demo: venv $(DEMO_STORE)/manifest.json
	$(PY) -m moestream generate -m $(DEMO_STORE) -p "def fibonacci(n):" -n 64 \
		--memory-budget $(DEMO_BUDGET) --threads 2

clean:
	rm -rf $(VENV) .cache .pytest_cache
