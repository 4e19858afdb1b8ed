# The README's two commands: `make run` (install + the embedded run) and `make test` (install + CPU tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned first: 2.13.0 is a CPU build on local disk; an unpinned torch would pull a CUDA build.
TORCH := torch==2.13.0
TRANSFORMERS := transformers==5.19.*

.PHONY: run test install bench clean-venv test-vllm

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q "$(TRANSFORMERS)" -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/earl-stream up $(ARGS)

test: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q $(PYTEST_ARGS)

# Benchmarks run in their own environment (.venv-bench: the project + the `bench` extra, i.e. TRL and
# Ray as peer baselines), so that installing them can never break the test environment (.venv).
BENCH_VENV ?= .venv-bench
BPY := $(BENCH_VENV)/bin/python

$(BENCH_VENV)/.installed: pyproject.toml
	test -x $(BPY) || python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q $(TORCH)
	$(BENCH_VENV)/bin/pip install -q "$(TRANSFORMERS)" -e ".[bench]"
	touch $@

# Every benchmark, then docs/BENCHMARKS.md from bench/results/*.json (BENCH_ARGS=--quick for a short pass).
bench: $(BENCH_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BPY) bench/dispatch.py $(BENCH_ARGS) --json bench/results/dispatch.json
	HF_HUB_OFFLINE=1 $(BPY) bench/memory_model.py $(BENCH_ARGS) --json bench/results/memory_model.json
	HF_HUB_OFFLINE=1 $(BPY) bench/selector.py $(BENCH_ARGS) --json bench/results/selector.json
	HF_HUB_OFFLINE=1 $(BPY) bench/engine.py $(BENCH_ARGS) --json bench/results/engine.json
	HF_HUB_OFFLINE=1 $(BPY) bench/learning.py $(BENCH_ARGS) --json bench/results/learning.json
	HF_HUB_OFFLINE=1 $(BPY) bench/e2e.py $(BENCH_ARGS) --json bench/results/e2e.json
	$(BPY) bench/report.py

clean-venv:
	rm -rf $(VENV)

# Optional tier: the vLLM backend for real on CPU, in its own environment (.venv-vllm, ~3.7 GB).
test-vllm:
	bash scripts/test-vllm.sh $(PYTEST_ARGS)
