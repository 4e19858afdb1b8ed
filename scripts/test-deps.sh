#!/usr/bin/env bash
# The dependency-range tier (`make test-deps`): the suite's core against the oldest and the newest versions
# pyproject.toml admits, each in an environment of its own built from scratch (not layered on .venv):
#
#   lowest  .venv-deps-lowest: every direct dependency at the lowest version its bound admits (uv's
#           --resolution lowest-direct: transformers, pyarrow, pyzmq, numpy, jinja2, ... at their floors)
#   newest  .venv-deps-newest: the newest versions the bounds admit (no constraints.txt, no transformers pin)
#
# torch is the exception in both: it is installed first by scripts/install-torch.sh at the Makefile's pin
# (TORCH_VERSION, the CPU or CUDA build as `make install` picks), because its floor (2.6) and newest releases
# are CUDA builds of several GB that CI cannot download; the torch range is what the GPU tier and CI ran.
#
#   bash scripts/test-deps.sh [lowest|newest|both] [pytest args]   (default: both)
#
# Each environment prints the versions it tested. DEPS_INSTALL_ONLY=1 builds the environments and stops.
set -euo pipefail
cd "$(dirname "$0")/.."

which=${1:-both}
[[ $# -gt 0 ]] && shift
case $which in
    lowest|newest) kinds=("$which") ;;
    both) kinds=(lowest newest) ;;
    *) echo "test-deps: choose lowest, newest or both, not '$which'" >&2; exit 2 ;;
esac
# shellcheck source=lib/venv.sh
source scripts/lib/venv.sh  # TORCH_PIN: the Makefile's pin, the default where `make` does not pass one
TORCH_VERSION=${TORCH_VERSION:-${TORCH_PIN#torch==}}
# the tests that exercise each direct dependency: the store (pyarrow, pyzmq, msgspec, cryptography), the
# models (transformers, tokenizers, safetensors, peft, pillow, jinja2's chat templates), the config (pyyaml),
# metrics (prometheus-client), the CLI (rich) and a whole run of `up` (all of them, matplotlib's plots too)
TESTS=(tests/model tests/store tests/test_config.py tests/test_modeling.py tests/test_chat.py tests/test_up.py
       tests/test_prometheus.py tests/test_lora_parallel.py)
DIRECT=(torch transformers tokenizers safetensors pyarrow pyzmq msgspec prometheus-client pyyaml numpy rich
        matplotlib pillow jinja2 cryptography peft pytest hypothesis)

build() {
    local kind=$1 venv=.venv-deps-$1
    local stamp=$venv/.project-installed
    [[ -f $stamp && ! pyproject.toml -nt $stamp ]] && return 0
    local started
    started=$(date +%s)
    echo "test-deps: building $venv ($kind versions)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    PIP=$venv/bin/pip TORCH_VERSION=$TORCH_VERSION bash scripts/install-torch.sh
    if [[ $kind == lowest ]]; then
        # uv resolves to the floors; it keeps the torch installed above (the requirement below pins it)
        "$venv/bin/pip" install -q uv
        "$venv/bin/uv" pip install -q -p "$venv/bin/python" --resolution lowest-direct \
            "torch==$TORCH_VERSION" -e ".[test]"
    else
        "$venv/bin/pip" install -q "torch==$TORCH_VERSION" -e ".[test]"
    fi
    touch "$stamp"
    echo "test-deps: $venv ready in $(( $(date +%s) - started )) s"
}

for kind in "${kinds[@]}"; do
    build "$kind"
done
[[ ${DEPS_INSTALL_ONLY:-0} == 1 ]] && exit 0

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for kind in "${kinds[@]}"; do
    venv=.venv-deps-$kind
    echo "test-deps: $kind versions: $("$venv/bin/python" -c 'import sys, importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${DIRECT[@]}")"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" \
        -m "not faults and not live and not lint" "${TESTS[@]}" "$@"
done
