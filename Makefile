# The two set-up commands of README.md: `make demo` (main job) and `make test` (tests).
# Each creates .venv when missing and installs what it needs (pinned by constraints.txt).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test test-oldest lint docs bench bench-gpu clean

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

demo: $(VENV)/.examples-installed $(VENV)/.cpu-extension
	$(PY) -m lightning_ext.examples.digits

lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check .

# pytest exits 5 when it collected no test: that is not a failure of the suite.
test: lint $(VENV)/.cpu-extension
	$(PY) -m pytest --nbmake lightning_ext tests notebooks; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The documentation site, strictly (a warning is an error; see docs/README.md): HTML with the notebooks
# executed into docs/_build/html, then the guides' examples as doctests. The notebooks draw their figures
# inline (`%matplotlib inline`) whatever MPLBACKEND says.
SPHINX := $(PY) -m sphinx -W --keep-going -d docs/_build/doctrees
docs: $(VENV)/.dev-installed $(VENV)/.cpu-extension
	$(SPHINX) -b html docs docs/_build/html
	$(SPHINX) -b doctest docs docs/_build/doctest
	@echo "open docs/_build/html/index.html"

# The unit tests and doctests (not the notebooks) at the lowest versions pyproject.toml allows.
OLDEST := .venv-oldest/bin/python
$(OLDEST):
	$(PYTHON) -m venv .venv-oldest
	$(OLDEST) -m pip install --disable-pip-version-check -q --upgrade pip "setuptools>=77"

test-oldest: | $(OLDEST)
	$(OLDEST) -m pip install --disable-pip-version-check -q -c constraints-oldest.txt -e ".[examples,test]"
	$(OLDEST) -m pytest -p no:cacheprovider lightning_ext tests

# Every benchmark script; each rewrites its own sections of benchmarks/RESULTS.md.
bench: $(VENV)/.dev-installed $(VENV)/.cpu-extension
	$(PY) benchmarks/run_all.py

# The CUDA tests and the GPU sections of the benchmarks, on a CUDA machine (elsewhere it says so and
# exits 0). GPU_PYTHON: an interpreter with a CUDA build of torch, e.g. `make bench-gpu GPU_PYTHON=python3`
# for the machine's own (the checkout goes on its PYTHONPATH); by default the development environment.
GPU_PYTHON ?= $(PY)
bench-gpu: $(if $(filter $(PY),$(GPU_PYTHON)),$(VENV)/.dev-installed)
	$(GPU_PYTHON) benchmarks/run_gpu.py

clean:
	rm -rf $(VENV) .venv-oldest runs lightning_logs .pytest_cache docs/_build
