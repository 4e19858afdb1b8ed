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

bench: $(VENV)/.installed
	$(PY) bench/dispatch.py --json bench/results/dispatch.json
	$(PY) bench/memory_model.py --json bench/results/memory_model.json
	$(PY) bench/learning.py --json bench/results/learning.json

clean-venv:
	rm -rf $(VENV)

# Optional tier: the vLLM backend for real on CPU, in its own environment (.venv-vllm, ~3.7 GB).
test-vllm:
	bash scripts/test-vllm.sh $(PYTEST_ARGS)
