# The set-up commands of README.md: `make demo` (main job), `make test` (every test, as CI) and
# `make test-fast` (the everyday loop, see CONTRIBUTING.md). Each creates .venv when missing and installs
# what it needs (pinned by constraints.txt).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test test-fast test-oldest test-newest test-matrix lint docs bench bench-gpu clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip

$(VENV)/.dev-installed: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e ".[dev]"
	touch $@ $(VENV)/.examples-installed  # dev includes the examples' extras

$(VENV)/.examples-installed: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e ".[examples]"
	touch $@

# The `cpu` kernel backend (compiled C++), built once ahead of the runs instead of at its first use;
# torch caches it per environment (torch, Python) and source. Without a compiler the `reference`
# backend serves CPU tensors.
$(VENV)/.cpu-extension: lightning_ext/csrc/kernels_cpu.cpp | $(VENV)/.examples-installed
	$(PY) -m lightning_ext.kernels || echo "the cpu kernel backend was not built: reference serves CPU tensors"
	touch $@

# The example jobs live in examples/ at the repository's top, outside the package: run from here.
demo: $(VENV)/.examples-installed $(VENV)/.cpu-extension
	$(PY) -m examples.digits

lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check .

# pytest exits 5 when it collected no test: that is not a failure of the suite. The notebooks run once,
# in the strict docs build of tests/docs (a cell that raises fails it), which also checks their figures.
# Two pytest-xdist workers, each test file on one of them (its module fixtures built once): most tests
# wait on processes they started, so two workers fill a 2-core machine that one leaves a third idle. The
# files are handed out in the order of collection, the longest first (conftest.py).
test: lint $(VENV)/.cpu-extension
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder lightning_ext examples tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# Everything but the tests marked `slow` (they start processes: multi-process tests, whole jobs, builds,
# the notebooks), plus the `smoke` tests, one per multi-process feature.
test-fast: $(VENV)/.dev-installed $(VENV)/.cpu-extension
	$(PY) -m pytest -q -m "not slow or smoke" lightning_ext examples tests

# The documentation site, strictly (a warning is an error; see docs/README.md): HTML with the notebooks
# executed into docs/_build/html, then the guides' examples as doctests. The notebooks draw their figures
# inline (`%matplotlib inline`) whatever MPLBACKEND says.
SPHINX := $(PY) -m sphinx -W --keep-going -d docs/_build/doctrees
docs: $(VENV)/.dev-installed $(VENV)/.cpu-extension
	$(SPHINX) -b html docs docs/_build/html
	$(SPHINX) -b doctest docs docs/_build/doctest
	@echo "open docs/_build/html/index.html"

# The supported range of pyproject.toml, outside CI (each corner but `ci` installs a CUDA build of torch
# from PyPI, a few GB, which runs on CPU): `make test-matrix` runs the unit tests and doctests (not the
# notebooks) in one virtual environment per corner, then prints one line per corner (versions, pytest's
# counts); it fails when a corner fails. pytest's output is also in runs/matrix/<corner>.log.
#   oldest  .venv-oldest  constraints-oldest.txt  the floors of pyproject.toml (alone: `make test-oldest`)
#   newest  .venv-newest  constraints-newest.txt  the newest releases supported (alone: `make test-newest`)
#   ci      .venv         constraints.txt         the CPU build of torch CI tests (`make test` adds the rest)
# Kept: a pattern rule's prerequisite is an intermediate file, which make would delete after the build
.PRECIOUS: .venv-%/bin/python
.venv-%/bin/python:
	$(PYTHON) -m venv .venv-$*
	$@ -m pip install --disable-pip-version-check -q --upgrade pip "setuptools>=77"

# A corner's packages, pinned by its constraints file, and its build of the cpu kernel backend.
.venv-%/.installed: constraints-%.txt pyproject.toml | .venv-%/bin/python
	.venv-$*/bin/python -m pip install --disable-pip-version-check -q -c constraints-$*.txt -e ".[examples,test]"
	.venv-$*/bin/python -m lightning_ext.kernels || echo "the cpu kernel backend was not built: reference serves CPU tensors"
	touch $@

# $(call corner,NAME,PYTHON): the tests with PYTHON, then NAME's line into runs/matrix/NAME.txt (and on
# the screen); the exit status is pytest's.
MATRIX_VERSIONS := import importlib.metadata as m, platform; print(*(f"{d} {m.version(d)}" for d in \
  ("torch", "lightning", "torchmetrics", "numpy")), f"python {platform.python_version()}", sep=", ")
define corner
mkdir -p runs/matrix; set -o pipefail; \
$(2) -m pytest -p no:cacheprovider -q lightning_ext examples tests 2>&1 | tee runs/matrix/$(1).log; rc=$$?; \
echo "$(1): $$($(2) -c '$(MATRIX_VERSIONS)'): $$(tail -n 1 runs/matrix/$(1).log | tr -d =)" \
  | tee runs/matrix/$(1).txt; exit $$rc
endef

test-oldest test-newest test-matrix: SHELL := /bin/bash
test-oldest: .venv-oldest/.installed
	@$(call corner,oldest,.venv-oldest/bin/python)

test-newest: .venv-newest/.installed
	@$(call corner,newest,.venv-newest/bin/python)

test-matrix: .venv-oldest/.installed .venv-newest/.installed $(VENV)/.dev-installed $(VENV)/.cpu-extension
	@failed=0; \
	($(call corner,oldest,.venv-oldest/bin/python)) || failed=1; \
	($(call corner,newest,.venv-newest/bin/python)) || failed=1; \
	($(call corner,ci,$(PY))) || failed=1; \
	echo; echo "make test-matrix:"; cat runs/matrix/oldest.txt runs/matrix/newest.txt runs/matrix/ci.txt; \
	exit $$failed

# Every benchmark script; each rewrites its own sections of benchmarks/RESULTS.md.
bench: $(VENV)/.dev-installed $(VENV)/.cpu-extension
	$(PY) benchmarks/run_all.py

# The CUDA tests, the main job on one GPU and the GPU sections of the benchmarks, on a CUDA machine
# (elsewhere it says so and exits 0). GPU_PYTHON: an interpreter with a CUDA build of torch, e.g.
# `make bench-gpu GPU_PYTHON=python3` for the machine's own (the checkout goes on its PYTHONPATH); by
# default the development environment.
GPU_PYTHON ?= $(PY)
bench-gpu: $(if $(filter $(PY),$(GPU_PYTHON)),$(VENV)/.dev-installed)
	$(GPU_PYTHON) benchmarks/run_gpu.py

clean:
	rm -rf $(VENV) .venv-oldest .venv-newest runs lightning_logs .pytest_cache docs/_build
