#!/usr/bin/env bash
# Installs bubblewrap (`bwrap`), which `sandbox.mode=bwrap` runs untrusted code in, from the Debian/Ubuntu
# archive. Needs root (or sudo); does nothing where a usable bwrap is already installed.
#   bash scripts/install-sandbox.sh
set -euo pipefail
if command -v bwrap >/dev/null && bwrap --ro-bind / / --unshare-all --die-with-parent true 2>/dev/null; then
    echo "bubblewrap $(bwrap --version | awk '{print $2}') is installed and can make its namespaces"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "install-sandbox.sh: run as root (apt-get install bubblewrap)" >&2; exit 1; }
    SUDO=sudo
fi
command -v apt-get >/dev/null || { echo "install-sandbox.sh: no apt-get here; install bubblewrap with your package manager" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q bubblewrap >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q bubblewrap >/dev/null; }
if ! bwrap --ro-bind / / --unshare-all --die-with-parent true; then
    echo "install-sandbox.sh: bubblewrap is installed but cannot make namespaces here (a container without" \
         "user namespaces?); sandbox.mode=bwrap falls back to process" >&2
    exit 1
fi
echo "bubblewrap $(bwrap --version | awk '{print $2}') installed"
