# Two entry points: `make demo` (main job on generated data) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/jdp demo

# -n: up to 4 worker processes (most tests are single-threaded JAX compiles); --dist loadfile keeps
# each file's module fixtures (e.g. the 4-device sharding subprocess) in one worker
TEST_WORKERS := -n auto --maxprocesses 4 --dist loadfile

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider --durations=25 $(TEST_WORKERS)

# the slow tests alone (notebooks at tiny size, multi-device sharding, real-data CLI runs): CI runs them after `test`
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow -p no:cacheprovider --durations=15 $(TEST_WORKERS)

# the default suite in ONE process (no xdist), as a long notebook runs: compiled programs pile up in it (issue 74:
# XLA's CPU compiler crashed at Linux's limit on memory mappings; see tests/conftest.py); CI runs it last
test-one-process: $(VENV)/.installed
	$(PY) -X faulthandler -m pytest -q -m "not slow" -p no:cacheprovider -p no:xdist --durations=10

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider $(TEST_WORKERS)

# the default suite on a GPU, in a Python that already has jax with CUDA and jdp's dependencies (no venv is made:
# e.g. `make test-gpu PY=python3`); 8 workers share the GPU, each allocating only what it uses
test-gpu:
	JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q -m "not slow" -p no:cacheprovider \
		--durations=25 -n 8 --dist loadfile -rfE

# a wheel of the checkout (pure Python: one file for every platform) for another machine or Colab
# (docs/install.md): no virtualenv needed; WHEEL_DIR is where it goes
WHEEL_DIR ?= dist
wheel:
	rm -rf build/lib  # setuptools' staging copy: a module deleted since the last build would ship otherwise
	$(PYTHON) -m pip wheel --no-deps --wheel-dir $(WHEEL_DIR) .
	@ls -1 $(WHEEL_DIR)/jdp_privacy-*.whl

.PHONY: install demo test test-slow test-one-process test-all test-gpu wheel
