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

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider

.PHONY: install demo test test-all
