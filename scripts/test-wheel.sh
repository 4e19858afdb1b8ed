#!/usr/bin/env bash
# The wheel as a user installs it (`make test-wheel`, called by .ci/run): builds the wheel, installs it into a fresh
# virtualenv outside the repository (CPU torch pinned first, as the Makefile does), and runs `earl-stream up --steps 3`
# on the embedded default from an empty directory, so nothing of the checkout (its envs/ folder, its sources on
# sys.path) can stand in for what the wheel lacks. Also checks that the wheel ships no generic top-level package
# (only earl_stream and earl_stream_envs) and that `pip install` printed no deprecation warning.
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/earl-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python3}

echo "test-wheel: building the wheel"
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$REPO" 2> "$WORK/build.log" || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/earl_stream-*.whl)
tops=$("$PY" -c "import sys, zipfile; print(' '.join(sorted({n.split('/')[0] for n in zipfile.ZipFile(sys.argv[1]).namelist() if not n.split('/')[0].endswith('.dist-info')})))" "$WHEEL")
if [[ "$tops" != "earl_stream earl_stream_envs" ]]; then
    echo "test-wheel: the wheel's top-level packages are '$tops', expected 'earl_stream earl_stream_envs'" >&2
    exit 1
fi

echo "test-wheel: installing $(basename "$WHEEL") into a fresh virtualenv"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --upgrade pip
"$WORK/venv/bin/pip" install -q torch==2.13.0
"$WORK/venv/bin/pip" install "$WHEEL" "transformers==5.19.*" > "$WORK/install.log" 2>&1 || { tail -50 "$WORK/install.log"; exit 1; }
if grep -i "deprecat" "$WORK/install.log" "$WORK/build.log"; then
    echo "test-wheel: the install printed deprecation warnings (above)" >&2
    exit 1
fi

echo "test-wheel: earl-stream up --steps 3 from an empty directory"
mkdir -p "$WORK/user"
cd "$WORK/user"
HF_HUB_OFFLINE=1 timeout 900 "$WORK/venv/bin/earl-stream" up --steps 3 run_dir=run > "$WORK/up.log" 2>&1 || {
    tail -40 "$WORK/up.log"; exit 1; }
"$WORK/venv/bin/python" - "$WORK/user/run/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["steps"] >= 3 and s["samples_trained"] > 0, s
print(f"test-wheel: passed ({s['steps']} steps, {s['samples_trained']} samples trained, {s['wall_seconds']:.0f} s)")
PY
