#!/usr/bin/env bash
# The UCX tier (`make test-ucx`): builds its own environment in $UCX_VENV (default .venv-ucx) with the
# project and its `ucx` extra (ucxx-cu12 and libucx, which install and run without a GPU), then runs the
# tests marked `ucx` there: the transport contract over UCX (rows and token ranges, checksums, a node
# killed mid-pull, authentication; tests/store/test_transport_contract.py), the transport choice, and a
# short `earl-stream up store.transport=ucx` whose every pull goes over UCX.
#
# Why a separate venv: ucxx-cu12 brings libucx and the CUDA Python bindings (~150 MB) that the main CPU
# suite does not need; without them the same tests skip there. UCX is told to use TCP and shared memory
# (no RDMA or GPU device here). Extra arguments are passed to pytest. UCX_INSTALL_ONLY=1 builds and stops.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${UCX_VENV:-.venv-ucx}"
# shellcheck source=lib/venv.sh
source scripts/lib/venv.sh
ensure_venv test-ucx "$VENV" ucx

if [[ "${UCX_INSTALL_ONLY:-0}" == "1" ]]; then
    exit 0
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false UCX_TLS="${UCX_TLS:-tcp,sm,self}" UCX_WARN_UNUSED_ENV_VARS=n
"$VENV/bin/python" -c "from earl_stream.store.ucx import ucx_available, ucx_import_error as e; \
assert ucx_available(), f'ucxx does not import in $VENV: {e()}'"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m ucx tests "$@"
