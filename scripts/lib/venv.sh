# Shared by the tier scripts that run the suite in an environment of their own (test-vllm, test-ray, test-ucx,
# test-ecosystems). Source it from the repository root.
#
# A tier's environment is layered on the main one (.venv, `make install`): a .pth file puts .venv's
# site-packages after the tier's own, so torch, transformers and the test tools are found there and never
# reinstalled (each reinstall of torch cost ~1 min), while whatever the tier's extra pins differently
# (verifiers' older datasets, vLLM's numpy) is installed in the tier's own site-packages, which comes first
# on sys.path. .venv itself is never written to. A tier is rebuilt when pyproject.toml or .venv changes.
TORCH_PIN="torch==2.13.0"            # the CPU build on local disk, as the Makefile's
TRANSFORMERS_PIN="transformers==5.19.*"
BASE_VENV="${BASE_VENV:-.venv}"

# layer_venv TIER VENV: create VENV (if needed) on top of $BASE_VENV, which must exist.
layer_venv() {
    local tier="$1" venv="$2"
    local base_py="$BASE_VENV/bin/python"
    if [[ ! -x "$base_py" ]]; then
        echo "$tier: $BASE_VENV is missing; run \`make install\` first (the tier's environment is layered on it)" >&2
        return 1
    fi
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    local base_site tier_site
    base_site=$("$base_py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    tier_site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    if [[ "$("$base_py" -c 'import sys; print(sys.version_info[:2])')" != \
          "$("$venv/bin/python" -c 'import sys; print(sys.version_info[:2])')" ]]; then
        echo "$tier: $venv and $BASE_VENV use different Pythons; remove $venv" >&2
        return 1
    fi
    echo "$(cd "$base_site" && pwd)" > "$tier_site/_earl_stream_base.pth"
    "$venv/bin/python" -m pip install -q --upgrade pip
}

# stale STAMP: true when the tier's project install is older than pyproject.toml or than .venv's install.
stale() {
    local stamp="$1"
    [[ ! -f "$stamp" ]] || [[ pyproject.toml -nt "$stamp" ]] || [[ "$BASE_VENV/.installed" -nt "$stamp" ]]
}

# ensure_venv TIER VENV EXTRA: VENV layered on .venv with the project and its `test` and EXTRA extras.
ensure_venv() {
    local tier="$1" venv="$2" extra="$3"
    local stamp="$venv/.project-installed"
    if stale "$stamp"; then
        local started
        started=$(date +%s)
        echo "$tier: building $venv (layered on $BASE_VENV) with the project's $extra extra"
        layer_venv "$tier" "$venv"
        "$venv/bin/python" -m pip install -q "$TORCH_PIN" "$TRANSFORMERS_PIN" -e ".[test,$extra]"
        touch "$stamp"
        echo "$tier: environment ready in $(( $(date +%s) - started )) s"
    fi
}
