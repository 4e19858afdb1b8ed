#!/usr/bin/env bash
# `make install`'s first step: torch, pinned, in the build that fits this machine, said on one line.
#
#   TORCH_INDEX=auto (default)  the CUDA build where an NVIDIA driver answers (`nvidia-smi -L`), else the CPU
#                               build; macOS: PyPI's build (CPU and MPS)
#   TORCH_INDEX=cuda            PyPI's Linux build (CUDA)
#   TORCH_INDEX=cpu             the CPU build: a `+cpu` wheel pip already finds (a local wheel directory or
#                               mirror in pip's config), else PyTorch's CPU index
#   TORCH_INDEX=URL             that index (e.g. https://download.pytorch.org/whl/cu128)
#
# A torch already installed at the pinned version is kept as it is (whatever its build).
# Environment: PIP (the venv's pip), TORCH_VERSION (the pin, from the Makefile).
set -euo pipefail
PIP=${PIP:?the venv pip}
VERSION=${TORCH_VERSION:?the pinned torch version}
INDEX=${TORCH_INDEX:-auto}
CPU_INDEX=https://download.pytorch.org/whl/cpu

have=$("${PIP%/pip}/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ ${have%%+*} == "$VERSION" ]]; then
    echo "torch: $have already installed (kept)"
    exit 0
fi
why="TORCH_INDEX=$INDEX"
if [[ $INDEX == auto ]]; then
    if [[ $(uname -s) == Darwin ]]; then
        INDEX=pypi why="macOS: PyPI's build (CPU and MPS)"
    elif command -v nvidia-smi >/dev/null && gpu=$(nvidia-smi -L 2>/dev/null | head -n1) && [[ $gpu ]]; then
        INDEX=cuda why="NVIDIA driver found: ${gpu%% (UUID*}"
    else
        INDEX=cpu why="no NVIDIA driver found (TORCH_INDEX=cuda installs the CUDA build anyway)"
    fi
fi
case $INDEX in
    cuda|pypi)
        echo "torch: $VERSION, PyPI's build ($why)"
        "$PIP" install -q "torch==$VERSION" ;;
    cpu)
        echo "torch: $VERSION, CPU build ($why)"
        # a +cpu wheel where pip's own config finds one (this is quick and works offline); else PyTorch's CPU index
        "$PIP" install -q "torch==$VERSION+cpu" 2>/dev/null \
            || "$PIP" install -q "torch==$VERSION" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple ;;
    http*|file:*)
        echo "torch: $VERSION from $INDEX"
        "$PIP" install -q "torch==$VERSION" --index-url "$INDEX" --extra-index-url https://pypi.org/simple ;;
    *)
        echo "install-torch: TORCH_INDEX=$INDEX: choose auto, cuda, cpu or an index URL" >&2
        exit 2 ;;
esac
echo "torch: $("${PIP%/pip}/python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda or "none")')"
