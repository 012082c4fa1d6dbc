# One-command entry points. `make train` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The venv's bin/ first on PATH: Slurm jobs started from the tests inherit it and find its torchrun.
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Installed into the new venv before the project. "" skips it: a torch already in $(VENV) stays, else pip
# installs the newest torch>=2.11 its index has (a GPU cluster puts its CUDA build into $(VENV) first: README).
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 8
LAYOUT ?= --parallelism.dp=2 --parallelism.tp=2 --parallelism.pp=2
# The demo's downstream task (`make data` builds it from the held-out plays), scored every evaluation.interval steps.
TASKS ?= --evaluation.tasks=data/eval/next_words.jsonl

.PHONY: setup data train test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

data: setup
	PYTHON=$(PY) bash scripts/prepare_data.sh

# The main job: the tiny model on the Shakespeare corpus, 3D-parallel (dp=2 x tp=2 x pp=2) on 8 CPU ranks,
# with the demo task's accuracy at steps 0, 100 and 200.
train: data
	OMP_NUM_THREADS=1 $(PY) -m nanotron.train --nproc_per_node $(NPROC) --config configs/tiny.toml $(LAYOUT) $(TASKS) $(ARGS)

# Two pytest workers (pytest-xdist) on the two cores, handed two tests at a time so that the tests marked
# `exclusive` (run alone, tests/conftest.py) stay at the end of the run; ARGS='-n 8' on a bigger machine.
test: setup
	$(PY) -m pytest -q -n 2 --maxschedchunk 2 $(ARGS)

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

clean:
	rm -rf runs logs .cache .pytest_cache
