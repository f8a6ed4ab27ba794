# LOPD platform. Fresh machine: `make demo` runs the main job, `make test` runs the test suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: venv demo demo-tiny test test-slow lint format bench clean

# Create/refresh the virtual environment. torch==2.13.0 goes first so nothing later pulls a CUDA build.
$(STAMP): pyproject.toml constraints.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "pip>=24"
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[all,dev]"
	$(PIP) install --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(PY) -m lopd_core.demo --backbone smollm2-135m

demo-tiny: venv
	$(PY) -m lopd_core.demo --backbone tiny

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: venv lint
	$(PY) -m pytest -q

test-slow: venv
	$(PY) -m pytest -q -m slow

bench: venv
	$(PY) bench/step_cost.py
	$(PY) bench/loss_memory.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
