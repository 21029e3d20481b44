# sonata: the two commands are `make train` and `make test`.
# Every target that needs Python depends on the venv stamp, so a fresh clone
# sets itself up on first use and later calls cost nothing.
PY      ?= $(shell command -v python3.11 || command -v python3)
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.sonata-installed
RUN     ?= runs/train
NB_ARGS ?=
# PyTorch's build: `cpu` unless this machine has an NVIDIA driver (nvidia-smi), or as asked
# (`make setup TORCH=cuda` / `TORCH=cpu`). On Linux the package index's torch is a CUDA
# build of several GB: the CPU build (2.13.0+cpu) comes from a local wheel cache when pip
# has one, else from PyTorch's CPU index (TORCH_CPU_INDEX). Elsewhere (macOS, Windows) the
# index's torch is the CPU build already.
TORCH_VERSION := 2.13.0
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(TORCH)-$(shell uname -s),cpu-Linux)
TORCH_INSTALL = pip install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_CPU_INDEX)
else ifneq ($(filter cpu cuda,$(TORCH)),)
TORCH_INSTALL = pip install -q "torch==$(TORCH_VERSION)"
else
TORCH_INSTALL = $(error TORCH must be cpu or cuda, not '$(TORCH)')
endif

export PYTHONHASHSEED := 0
export TIKTOKEN_CACHE_DIR ?= $(CURDIR)/.cache/tiktoken
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: setup train test test-fast fuzz bench lint clean lab

setup: $(STAMP)

# The chosen torch build first: with torch already satisfied, installing the package never
# pulls another one. The stamp follows this Makefile too (a changed recipe re-runs it).
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || { rm -rf $(VENV); \
		echo "error: '$(PY) -m venv' failed: Python's venv module is missing (Debian and Ubuntu: apt-get install python3-venv)" >&2; exit 2; }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m $(TORCH_INSTALL)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (sonata)" >/dev/null
	@touch $(STAMP)

# The main job: run notebook 01 headlessly with its default parameters.
train: $(STAMP)
	@mkdir -p $(RUN)
	$(BIN)/papermill notebooks/01_train_tinystories.ipynb $(RUN)/01_train_tinystories.ipynb \
		-k python3 -p out_dir $(RUN) $(NB_ARGS)
	@echo "executed notebook: $(RUN)/01_train_tinystories.ipynb"

# JupyterLab from .venv with the project's kernel, on 127.0.0.1 with a free port and a
# fresh token (LAB_PORT=... to choose the port); prints the URL to open.
lab: $(STAMP)
	@.ci/lab $(BIN)/python $(CURDIR)

# nbval re-runs each notebook at its defaults, but not the five whose default is a long
# training run: notebook 01 (1,500 steps, 1-3 minutes; `make train` is that run), notebook
# 07 (five runs of 10 minutes), notebook 08 (about two hours of runs), notebook 10 (24 runs
# of 2,000-3,000 steps) and notebook 11 (35 runs of 2,000 steps). tests/test_notebooks.py runs them under papermill with short budgets
# and checks notebook 01's nbval-checked cells.
#
# Both runs spread their files over TEST_WORKERS processes (pytest-xdist; a file's tests stay in
# one worker, so its module fixtures run once): 2, this project's machines' cores, unless set;
# TEST_WORKERS=0 runs everything in one process. OpenMP threads sleep while they wait
# (OMP_WAIT_POLICY=passive): two workers' thread pools on two cores would otherwise spin on the
# cores the other worker needs.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: export OMP_WAIT_POLICY ?= passive
test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) tests
	$(BIN)/python -m pytest -q $(XDIST) --nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider \
		--ignore=notebooks/01_train_tinystories.ipynb --ignore=notebooks/07_ten_minute_speedrun.ipynb \
		--ignore=notebooks/08_selection.ipynb --ignore=notebooks/10_recall_and_state.ipynb \
		--ignore=notebooks/11_state_tracking_table.ipynb notebooks

# The config fuzz (tests/train/test_config_fuzz.py) at length, from a fresh seed each time:
# every example trains, or is one error line that leaves its --out folder byte-identical.
SONATA_FUZZ_EXAMPLES ?= 400
fuzz: export OMP_WAIT_POLICY ?= passive
fuzz: $(STAMP)
	SONATA_FUZZ_EXAMPLES=$(SONATA_FUZZ_EXAMPLES) SONATA_FUZZ_FRESH=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/train/test_config_fuzz.py

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not notebook" tests

# Unused imports and names, undefined names (pyflakes); make test runs it too (tests/test_project.py)
lint: $(STAMP)
	$(BIN)/python -m pyflakes sonata tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/scan.py
	$(BIN)/python benchmarks/train_speed.py

# numba's compiled kernels are cached beside their sources (__pycache__/*.nbi, *.nbc)
clean:
	rm -rf $(VENV) .cache .pytest_cache runs
	find sonata -name '*.nbi' -delete -o -name '*.nbc' -delete
