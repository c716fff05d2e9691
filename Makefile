# The two set-up commands of README.md: `make demo` (main job) and `make test` (tests).
# Each creates .venv when missing and installs what it needs (pinned by constraints.txt).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip

$(VENV)/.dev-installed: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e ".[dev]"
	touch $@ $(VENV)/.examples-installed  # dev includes the examples' extras

$(VENV)/.examples-installed: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e ".[examples]"
	touch $@

# The compiled CPU kernels of SyncBatchNorm, built once ahead of the runs (~40 s on 2 cores) instead of
# at the first forward; torch caches it by source. Without a compiler SyncBatchNorm uses its Python path.
$(VENV)/.cpu-extension: lightning_ext/csrc/sync_batch_norm_cpu.cpp | $(VENV)/.examples-installed
	$(PY) -m lightning_ext.kernels.cpu_extension || echo "CPU extension not built: SyncBatchNorm uses its Python path"
	touch $@

demo: $(VENV)/.examples-installed $(VENV)/.cpu-extension
	$(PY) -m lightning_ext.examples.digits

lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check .

# pytest exits 5 when it collected no test: that is not a failure of the suite.
test: lint $(VENV)/.cpu-extension
	$(PY) -m pytest --nbmake lightning_ext tests notebooks; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: $(VENV)/.dev-installed $(VENV)/.cpu-extension
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache
