#!/usr/bin/env bash
# Build the optional tiers' environments (.venv-vllm, .venv-ray, .venv-ucx, .venv-ecosystems, .venv-deps-*)
# without running their tests: each tier script's *_INSTALL_ONLY=1 path, one after the other. Needs .venv (`make install`).
#
# .ci/run starts it in the background right after `make install`, so that these builds (~2 min, mostly
# download and unpacking: vLLM 56 s, Ray 21 s, UCX 13 s, ecosystems 31 s measured here) overlap `make test`
# instead of adding to the total. A tier whose environment is already current skips its build, so running a
# tier afterwards only runs its tests. Prints each build's seconds; exits non-zero at the first failed build
# (the tier would then try again, and fail with its own message).
set -euo pipefail
cd "$(dirname "$0")/.."
for tier in vllm ray ucx ecosystems deps; do
    started=$(date +%s)
    case $tier in
        vllm) VLLM_INSTALL_ONLY=1 bash scripts/test-vllm.sh ;;
        ray) RAY_INSTALL_ONLY=1 bash scripts/test-ray.sh ;;
        ucx) UCX_INSTALL_ONLY=1 bash scripts/test-ucx.sh ;;
        ecosystems) ECO_INSTALL_ONLY=1 bash scripts/test-ecosystems.sh ;;
        deps) DEPS_INSTALL_ONLY=1 bash scripts/test-deps.sh both ;;
    esac
    echo "build-tier-envs: $tier ready in $(( $(date +%s) - started )) s"
done
