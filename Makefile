# `make train` and `make test` are the whole set-up: each (re)creates .venv when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export PYTHONUNBUFFERED := 1

.PHONY: train test venv clean

# pip's output is cut to one line per package it collects: a first install shows progress
$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (first use, or pyproject.toml changed; later runs skip this): installing torch (CPU),"
	@echo "triton, megatron-core, hydra, wandb, tensorboard, transformers and their dependencies; a few minutes"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --disable-pip-version-check --progress-bar off --ignore-requires-python -e ".[deepspeed]" 2>&1 \
		| grep --line-buffered -E "^(Collecting|Successfully installed|ERROR)" || true
	@$(PY) -c "import torch, megatron.core, hydra, triton, deepspeed" > $(VENV)/import-check.log 2>&1 \
		|| { cat $(VENV)/import-check.log; echo "virtualenv install failed: an import above failed"; exit 1; }
	@touch $(STAMP)
	@echo "$(VENV) is ready; \`source $(VENV)/bin/activate\` puts its python and torchrun on your PATH"

venv: $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# two pytest workers (pytest-xdist), each taking a whole test file at a time, so a file's shared
# fixtures are built once: most tests run one single-threaded process (train.py with
# OMP_NUM_THREADS=1, Triton's interpreter), which leaves the other core idle. Files go out in the
# order tests/conftest.py sorts them (longest first). TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 2

# the tests start some hundreds of Python processes that import the project's modules: compiled
# once here, they are not compiled again in each (where PYTHONDONTWRITEBYTECODE keeps Python from
# caching them itself, which saves about 0.4 s of CPU a process)
test: $(STAMP)
	@$(PY) -m compileall -q -j 0 msa_model data launch bench scripts train.py > /dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs runs .cache
