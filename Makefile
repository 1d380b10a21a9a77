# The two commands a newcomer needs:
#   make lab    installs everything into .venv and opens JupyterLab on notebooks/ (as root and on
#               a headless machine too: it prints the URL to open, token included)
#   make test   installs everything into .venv and runs the test suite (pytest, then nbval on the
#               notebooks); tests marked slow (whole grids, fault drills over ~20 s, cases whose
#               code a faster default case runs) are left out: make test-slow runs them,
#               make test-all runs both; --durations=15 lists the slowest tests in the log
#   make browser-test  JupyterLab in headless Chromium: notebook 00's dashboard rendered, live,
#               and stopped (needs apt-get install chromium chromium-driver; refreshes
#               docs/screenshots/)
# TORCH picks the torch requirement installed first. The CI machine's pip serves the CPU build of
# torch==2.13.0; where plain PyPI would pull the multi-GB CUDA build instead, name PyTorch's CPU
# index: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# On a GPU machine: make lab TORCH=torch
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
LAB_PORT ?= 8888
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lab test test-slow test-all browser-test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lab: install
	$(BIN)/python -m dlab lab --port $(LAB_PORT)

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -q -m "not slow and not browser" --durations=15
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
		OMP_NUM_THREADS=1 $(BIN)/python -m pytest --nbval-lax -q notebooks; \
	fi

test-slow: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -q -m slow

test-all: test test-slow

browser-test: install
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		echo "make browser-test drives Debian's Chromium: apt-get install chromium chromium-driver"; \
		exit 2; }
	$(BIN)/python -m pip install -q -e ".[browser]"
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/browser -q -s -m browser

clean:
	rm -rf $(VENV) runs .pytest_cache
