# `make train` and `make test` are the whole set-up: each (re)creates .venv when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export PYTHONUNBUFFERED := 1

.PHONY: train test venv clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --ignore-requires-python -e ".[deepspeed]" 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import torch, megatron.core, hydra, triton, deepspeed" || { echo "virtualenv install failed"; exit 1; }
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs runs .cache
