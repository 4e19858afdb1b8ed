#!/usr/bin/env bash
# The GPU tier (a machine with a CUDA GPU): the tests marked `gpu`, then a short `earl-stream up` of the
# embedded default whose trainer (bf16 autocast, NCCL-capable pool) and built-in engine run on CUDA.
# Checks from the run's logs that both really computed on CUDA and that the run trained every step.
# Usage: make test-gpu  (or PY=python3 bash scripts/test-gpu.sh where the project is installed already)
# Writes build/gpu_check.json (GPU_RESULT=PATH: elsewhere; a GPU run is history, docs/history.md, not a cited result); GPU_COMMIT=SHA names the commit where git on the host cannot
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=${GPU_RUN_DIR:-runs/gpu-check}
STEPS=${GPU_STEPS:-6}
export HF_HUB_OFFLINE=1
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("test-gpu: torch sees no CUDA device here (torch %s); this tier needs one" % torch.__version__)
print("torch", torch.__version__, "on", torch.cuda.get_device_name(), flush=True)
PYEOF
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/workers/test_train_step_cuda.py \
    tests/workers/engines/test_torch_engine_cuda.py tests/workers/engines/test_torch_engine_bf16.py tests/test_devices_cuda.py "$@"
rm -rf "$RUN"
start=$(date +%s)
"$PY" -m earl_stream up --steps "$STEPS" --summary "$RUN/summary.json" "run_dir=$RUN" trainer.dtype=bf16
echo "up: $STEPS steps in $(( $(date +%s) - start )) s (model build included)"
grep -h "computes on\|generates on" "$RUN"/logs/*.log | sed 's/^/  /'
grep -q "computes on cuda" "$RUN"/logs/*.log || { echo "test-gpu: the trainer did not compute on cuda"; exit 1; }
grep -q "generates on cuda" "$RUN"/logs/*.log || { echo "test-gpu: the engine did not generate on cuda"; exit 1; }
"$PY" - "$RUN/summary.json" "$STEPS" "${GPU_RESULT:-build/gpu_check.json}" "$RUN" <<'PYEOF'
import datetime, glob, json, os, subprocess, sys
import torch, transformers
s = json.load(open(sys.argv[1]))
if s.get("steps") != int(sys.argv[2]):
    sys.exit(f"test-gpu: the run stopped at step {s.get('steps')} of {sys.argv[2]}")
placed = [line.split(": ", 1)[1].strip() for f in sorted(glob.glob(sys.argv[4] + "/logs/*.log")) for line in open(f)
          if "computes on" in line or "generates on" in line]
# GPU_COMMIT: where the tree was copied onto the GPU host without its git history (git there names another commit)
commit = os.environ.get("GPU_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
result = {"what": "make test-gpu: the gpu-marked tests passed, then `earl-stream up` on the embedded default",
          "device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
          "date": datetime.date.today().isoformat(), "commit": commit, "placement_logged": placed,
          "up": {k: s.get(k) for k in ("steps", "samples_trained", "samples_produced", "win_rate_last",
                                       "tokens_per_second", "wall_seconds", "samples_lost", "duplicates_detected")}}
print(result["up"])
os.makedirs(os.path.dirname(sys.argv[3]) or ".", exist_ok=True)
json.dump(result, open(sys.argv[3], "w"), indent=1)
PYEOF
echo "test-gpu: passed"
