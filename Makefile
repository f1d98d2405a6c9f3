# Asteria developer entry points.
#
#   make demo          set up .venv, build, compare AdamW and SOAP on a tiny LM (a few minutes on CPU)
#   make test          set up .venv, build, run the test suite
#   make build         set up .venv and build the extension (asteria._C)
#   make bench         set up .venv, build, time one optimizer step vs peers (bench/optim_step.py)
#   make lint          ruff check, ruff format --check, clang-format --dry-run -Werror
#   make cuda-compile  compile the CUDA sources in .venv-cuda (CUDA torch; no GPU needed)
#
# Setup is idempotent: each step leaves a stamp file under $(VENV)/.stamps and runs again only
# when its inputs change (requirements-test.txt for the packages; setup.py, pyproject.toml and
# csrc/ for the build). Deleting the venv starts over. torch is installed first, pinned, and
# pinned again on the requirements command line so that no dependency can replace it.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
CUDA_VENV ?= .venv-cuda
CUDA_TORCH_VERSION ?= 2.14.1
MAX_JOBS ?= 2
export MAX_JOBS

PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMPS := $(VENV)/.stamps
CUDA_PY := $(CUDA_VENV)/bin/python
CUDA_STAMPS := $(CUDA_VENV)/.stamps

BUILD_INPUTS := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)
CXX_SOURCES = $(shell find csrc tests/cpp \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' \
	-o -name '*.cu' -o -name '*.cuh' \) -type f 2>/dev/null | sort)

.PHONY: help setup build demo test bench lint cuda-compile clean distclean

help:
	@sed -n '3,9p' Makefile | sed 's/^# //'

# -- the CPU venv ------------------------------------------------------------------------------

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMPS)/torch: | $(PY)
	$(PIP) install "torch==$(TORCH_VERSION)"
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/requirements: requirements-test.txt $(STAMPS)/torch
	$(PIP) install -r requirements-test.txt "torch==$(TORCH_VERSION)"
	@touch $@

$(STAMPS)/build: $(STAMPS)/requirements $(BUILD_INPUTS)
	$(PIP) install --no-build-isolation --no-deps -e .
	@touch $@

setup: $(STAMPS)/requirements

build: $(STAMPS)/build

demo: build
	$(PY) -m asteria.train

test: build
	$(PY) -m pytest -q

bench: build
	$(PY) bench/optim_step.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SOURCES)

# -- the CUDA compile check (CUDA torch wheel + nvcc; compiles, never runs) --------------------

$(CUDA_PY):
	$(PYTHON) -m venv $(CUDA_VENV)

$(CUDA_STAMPS)/packages: | $(CUDA_PY)
	$(CUDA_PY) -m pip --disable-pip-version-check install "torch==$(CUDA_TORCH_VERSION)"
	$(CUDA_PY) -m pip --disable-pip-version-check install "torch==$(CUDA_TORCH_VERSION)" \
		pybind11 ninja numpy setuptools wheel
	@mkdir -p $(CUDA_STAMPS) && touch $@

cuda-compile: $(CUDA_STAMPS)/packages
	source $(CUDA_VENV)/bin/activate && tools/compile_cuda.sh

# -- cleaning ----------------------------------------------------------------------------------

clean:
	rm -rf build asteria/_C*.so asteria/_build_info.py *.egg-info $(STAMPS)/build

distclean: clean
	rm -rf $(VENV) $(CUDA_VENV)
