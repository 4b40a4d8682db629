# Every target sets itself up in a local virtualenv (.venv): `make prepare`, `make test` on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.musekern-installed
BUILD_STAMP := $(VENV)/.musekern-build-installed
# `make prepare` installs only what a build stage needs (musekern[build]: the CuTe DSL, no torch); `make test`
# adds torch and the test tools. Without a GPU, torch must be the CPU build: a wheel in a local find-links
# folder (/opt/wheels here) if there is one, else PyTorch's CPU index.
TORCH_CPU_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-*+cpu-*.whl))
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install prepare test lint readme gpu-test bench clean-venv

install: $(STAMP)

$(BUILD_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[build]"
	touch $(BUILD_STAMP)

$(STAMP): $(BUILD_STAMP)
ifeq ($(HAVE_GPU),)
ifneq ($(TORCH_CPU_WHEEL),)
	$(PIP) install -q "$(TORCH_CPU_WHEEL)"
else
	$(PIP) install -q torch --index-url $(TORCH_CPU_INDEX)
endif
endif
	$(PIP) install -q -e ".[build,sign,test,torch]"
	touch $(STAMP)

prepare: $(BUILD_STAMP)
	$(VENV)/bin/musekern prepare

# every run also leaves its per-test record (tracebacks of failures included) in .pytest-last.xml, so a rare
# failure whose console output was lost can still be read
test: install
	$(PY) -m pytest --junitxml=.pytest-last.xml -o junit_family=xunit1 $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check musekern tests bench examples

# Rewrite the README's `make prepare` transcript from a real run (tests/test_readme_flows.py checks it).
readme: install
	$(PY) tests/test_readme_flows.py

# On the GPU machine (no cutlass there): loader + GPU tests against a cache built here and carried.
gpu-test:
	bash bench/gpu_round.sh

# On the GPU machine: the issue-5 benchmark (qkv_front modes vs cuBLAS/unfused/copy, qk_norm, host costs).
bench:
	bash bench/gpu_bench.sh

clean-venv:
	rm -rf $(VENV)
