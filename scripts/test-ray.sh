#!/usr/bin/env bash
# The Ray test tier (`make test-ray`): builds its own environment in $RAY_VENV (default .venv-ray) with the
# project and its `ray` extra, then runs the tests marked `ray` there: a real two-node Ray cluster started
# on this host (ray.cluster_utils.Cluster), `earl-stream up --launcher ray` placed across its nodes.
#
# Why a separate venv: ray[default] adds ~360 MB that the main CPU suite does not need, and its pins must
# never break the test environment (.venv). The project is reinstalled only when pyproject.toml changes.
# Extra arguments are passed to pytest. Set RAY_INSTALL_ONLY=1 to build the environment and stop.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${RAY_VENV:-.venv-ray}"
# shellcheck source=lib/venv.sh
source scripts/lib/venv.sh
ensure_venv test-ray "$VENV" ray

if [[ "${RAY_INSTALL_ONLY:-0}" == "1" ]]; then
    exit 0
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m ray tests "$@"
