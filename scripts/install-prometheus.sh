#!/usr/bin/env bash
# Install the Prometheus server (Debian's `prometheus` package) for tests/test_prometheus.py.
#
# Installs only when `prometheus` is missing and we can install system packages (root, or passwordless
# sudo). Otherwise it says why and exits 0: the Prometheus test then skips with that reason. The
# package is not started as a service here (tests start their own server on 127.0.0.1).
set -uo pipefail

if command -v prometheus >/dev/null 2>&1; then
    echo "install-prometheus: already installed: $(command -v prometheus)"
    exit 0
fi
if [ -x /usr/bin/prometheus ]; then
    echo "install-prometheus: already installed: /usr/bin/prometheus"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-prometheus: no apt-get here (not Debian/Ubuntu); install Prometheus by hand to run its test"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "install-prometheus: not root and no passwordless sudo; skipping (run as root to install it)"
    exit 0
fi

echo "install-prometheus: installing Debian's prometheus package (~330 MB)"
# DEBIAN_FRONTEND inside the command: sudo does not pass the caller's environment on.
if ${SUDO[@]+"${SUDO[@]}"} sh -c 'apt-get update &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus'; then
    echo "install-prometheus: installed $(command -v prometheus || echo /usr/bin/prometheus)"
else
    echo "install-prometheus: apt-get failed (exit $?); the Prometheus test will skip"
fi
exit 0
