#!/usr/bin/env bash
# The GPU preset check, one command on a machine with a CUDA GPU: builds random weights of Qwen3-1.7B's shape
# locally (no download), runs `earl-stream up --config configs/gpu_single.yaml --steps 3` on them, and writes
# build/gpu_preset_check.json (card, steps, samples trained, wall time, peak card memory, trainer plans,
# decode path). About 3-5 minutes on one H100/H200 (estimated: not yet run); `up` is stopped after 7 minutes.
# It runs the preset with eval.every=0, algo.dynamic_sampling=false and trainer.groups_per_step=8, which random
# weights need (scripts/gpu_check.py says why); memory budgets, dtypes and engine are the preset's.
# Exits 2 with a message where torch sees no CUDA GPU, 1 where the run fails or stops short.
# Usage: bash scripts/gpu-check.sh [--steps N] [--timeout S] [--out PATH]   (PY=python3 where the project is
# installed outside .venv; --cpu-smoke checks the script itself on a CPU, proving nothing about a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1  # the model is built here: nothing may be downloaded
exec "$PY" scripts/gpu_check.py "$@"
