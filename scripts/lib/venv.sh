# Shared by the tier scripts that run the suite in an environment of their own (test-ray, test-ucx,
# test-ecosystems): `ensure_venv TIER VENV EXTRA` builds VENV with the pinned CPU torch, then the project
# with its `test` extra and EXTRA, and rebuilds the project install only when pyproject.toml changed.
# Source it from the repository root.
TORCH_PIN="torch==2.13.0"            # the CPU build on local disk, as the Makefile's
TRANSFORMERS_PIN="transformers==5.19.*"

ensure_venv() {
    local tier="$1" venv="$2" extra="$3"
    local py="$venv/bin/python" stamp="$venv/.project-installed"   # older than pyproject.toml -> reinstall
    if [[ ! -f "$stamp" ]] || [[ pyproject.toml -nt "$stamp" ]]; then
        local started
        started=$(date +%s)
        echo "$tier: building $venv with the project's $extra extra"
        [[ -x "$py" ]] || python3 -m venv "$venv"
        "$py" -m pip install -q --upgrade pip
        "$py" -m pip install -q "$TORCH_PIN"
        "$py" -m pip install -q "$TRANSFORMERS_PIN" -e ".[test,$extra]"
        touch "$stamp"
        echo "$tier: environment ready in $(( $(date +%s) - started )) s"
    fi
}
