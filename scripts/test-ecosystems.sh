#!/usr/bin/env bash
# The environment-ecosystem tier (`make test-ecosystems`): builds its own environment in $ECO_VENV (default
# .venv-ecosystems) with the project and its `ecosystems` extra (verifiers, openenv-core), then runs the
# tests marked `ecosystems`: each adapter plays an episode of a real environment of its package, offline
# (a verifiers environment written in the test and loaded with `load_environment`; an OpenEnv server
# started locally in the test, no containers).
#
# Why a separate venv: verifiers pins datasets/huggingface_hub/regex versions older than the test
# environment's (.venv), and openenv-core brings FastAPI/uvicorn; they must never break .venv. The
# Gymnasium adapter needs nothing of this: gymnasium is in the `test` extra and runs in the main suite.
# Extra arguments are passed to pytest. Set ECO_INSTALL_ONLY=1 to build the environment and stop.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${ECO_VENV:-.venv-ecosystems}"
# shellcheck source=lib/venv.sh
source scripts/lib/venv.sh
ensure_venv test-ecosystems "$VENV" ecosystems

if [[ "${ECO_INSTALL_ONLY:-0}" == "1" ]]; then
    exit 0
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m ecosystems tests/envs "$@"
