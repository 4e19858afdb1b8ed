#!/usr/bin/env bash
# One prepared run on a lent GPU host (the device tool): the GPU tier (make test-gpu's tests and a short `up` on
# CUDA), then bench/real_scale_single.py (SmolLM2-135M's architecture, bf16, contexts 1K -> 16K under a 24 GiB
# cap) and bench/rollout_memory.py (the built-in engine's KV admission under a 1 GiB CUDA cap). Results go to $OUT (or bench/results). The host's python has torch; the project's other dependencies it
# lacks travel as wheels in .whl/ (pyzmq, msgspec, cryptography, cffi, pycparser, pytest-rerunfailures).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "project install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rc=0
if [ -z "${SKIP_TIER:-}" ]; then
  GPU_RESULT=$OUT/gpu_check.json GPU_COMMIT=${GPU_COMMIT:-} PY=python3 timeout 300 bash scripts/test-gpu.sh 2>&1 | tail -25 || rc=1
fi
timeout 240 python3 bench/real_scale_single.py --device cuda --dtype bf16 --cap-gib 24 \
  --lengths 1024,2048,4096,8192,16384 --rows 8 --steps 2 --json "$OUT/real_scale_gpu.json" || rc=1
timeout 150 python3 bench/rollout_memory.py --device cuda --memory-mib 1024 --json "$OUT/rollout_memory_gpu.json" \
  2>&1 | tail -15 || rc=1
exit $rc
