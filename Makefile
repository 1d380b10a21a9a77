# The two commands a newcomer needs:
#   make lab    installs everything into .venv and opens JupyterLab on notebooks/ (as root and on
#               a headless machine too: it prints the URL to open, token included)
#   make test   installs everything into .venv and runs the test suite (pytest, then nbval on the
#               notebooks); tests marked slow (whole grids, fault drills over ~20 s, cases whose
#               code a faster default case runs) are left out: make test-slow runs them,
#               make test-all runs both; --durations=15 lists the slowest tests in the log
#   make browser-test  JupyterLab in headless Chromium: notebook 00's dashboard rendered, live,
#               and stopped (needs apt-get install chromium chromium-driver); its screenshots
#               go to a temporary directory: make screenshots runs it to refresh the README's
#               images in docs/screenshots/
#   make gpu-session  on a lent GPU: python -m dlab gpu (calibration, a profiled step, attention
#               kernels, matmul by precision, the allocator, NCCL, check) into
#               data/gpu/<device>-<date>/, under 10 minutes on one H100; it needs no network: the
#               venv's python where there is one, else $(PY) with the machine's own CUDA torch
#               (GPU_ARGS: e.g. --quick, or --steps attention,matmul --out data/gpu/<folder>)
#   make assignments  the checked exercises as an nbgrader course in build/assignments/ (ASSIGNMENTS=
#               another folder): source/ with the reference solutions, release/ without them, for
#               a graded course (docs/instructor/assignments.md)
#   make test-compat  the oldest torch dlab declares (TORCH_FLOOR, pyproject.toml's floor) in
#               its own venv ($(VENV)/compat), and a subset of the tests that touches every
#               family of strategies, checkpoints, the wire meter and the CLI
# TORCH picks the torch requirement installed first. The CI machine's pip serves the CPU build of
# torch==2.13.0; where plain PyPI would pull the multi-GB CUDA build instead, name PyTorch's CPU
# index: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# On a GPU machine: make lab TORCH=torch (pyproject.toml sets torch's floor, no cap, so the
# newest release stays as it is installed)
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_FLOOR ?= torch==2.6.0
COMPAT_VENV ?= $(VENV)/compat
# one default case per family of strategies (data, ZeRO, pipeline, tensor, context, expert,
# nd), a ZeRO checkpoint resumed and resharded, the measured wire bytes, the launcher's failures
COMPAT_TESTS ?= "tests/test_data_parallel.py::test_matches_single_and_moves_the_formula_bytes[ddp-2]" \
	"tests/test_zero.py::test_stage_matches_single_and_its_formulas" \
	"tests/test_checkpoint.py::test_zero2_resumes_and_reshards_parameters_its_shard_boundary_cuts" \
	tests/test_pipeline_parity.py tests/test_tensor_parity.py tests/test_context_parity.py \
	tests/test_expert_parity.py tests/test_wire_bytes.py tests/test_faults.py tests/test_install.py
LAB_PORT ?= 8888
ASSIGNMENTS ?= build/assignments
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lab test test-slow test-all browser-test screenshots assignments test-compat gpu-session bench clean

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

screenshots:
	DLAB_SCREENSHOTS=$(CURDIR)/docs/screenshots $(MAKE) browser-test

gpu-session:
	PYTHONPATH=$(CURDIR) $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) -m dlab gpu $(GPU_ARGS)

assignments: install
	$(BIN)/python -m pip install -q -e ".[grading]"
	$(BIN)/python -m dlab assignments --out $(ASSIGNMENTS)

test-compat:
	test -x $(COMPAT_VENV)/bin/python || $(PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q "$(TORCH_FLOOR)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(COMPAT_VENV)/bin/python -m pip install -q -e . "pytest>=8"
	$(COMPAT_VENV)/bin/python -c "import torch; print('test-compat on torch', torch.__version__)"
	OMP_NUM_THREADS=1 $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" $(COMPAT_TESTS)

clean:
	rm -rf $(VENV) runs .pytest_cache
