# Quick start: `make demo` then `make test`. Both build the venv from scratch when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
DEMO_MODEL ?= .cache/demo-model

.PHONY: venv test lint demo clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,plot,serve]"
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(PY) -m ruff check moestream tests benchmarks scripts

test: venv lint
	$(PY) -m pytest -q

$(DEMO_MODEL)/config.json: | venv
	$(PY) scripts/make_demo_model.py $(DEMO_MODEL)

demo: venv $(DEMO_MODEL)/config.json
	$(PY) -m moestream generate -m $(DEMO_MODEL) -p "def fibonacci(n):" -n 48

clean:
	rm -rf $(VENV) .cache .pytest_cache
