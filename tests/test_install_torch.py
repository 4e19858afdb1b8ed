"""scripts/install-torch.sh, `make install`'s first step: which torch build it asks pip for on a machine with and
without an NVIDIA driver, what TORCH_INDEX overrides, and that it says which on its first line. pip, python and
nvidia-smi are stand-ins on PATH that record their arguments: the decision is the script's, not pip's."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install-torch.sh"


def _tool(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, *, gpu: bool, index: str = "auto", plus_cpu_found: bool = True,
         installed: str = "") -> tuple[subprocess.CompletedProcess[str], list[str]]:
    venv, bin_dir = tmp_path / "venv", tmp_path / "bin"
    venv.mkdir()
    bin_dir.mkdir()
    log = tmp_path / "pip.log"
    refuse = "" if plus_cpu_found else '[[ "$*" == *"+cpu"* ]] && exit 1\n'
    _tool(venv / "pip", f'{refuse}echo "$*" >> {log}\ntouch {tmp_path}/installed\n')
    # torch's version: `installed` before any pip install, 2.13.0 after one (exit 1: no torch)
    _tool(venv / "python", f'[[ -e {tmp_path}/installed ]] && {{ echo "2.13.0 CUDA x"; exit 0; }}\n'
                           + (f'echo {installed}\n' if installed else "exit 1\n"))
    for tool in ("bash", "uname", "head", "touch"):  # PATH is this directory alone: no host nvidia-smi is seen
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    if gpu:
        _tool(bin_dir / "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0000)"\n')
    env = {**os.environ, "PATH": str(bin_dir), "PIP": str(venv / "pip"), "TORCH_VERSION": "2.13.0",
           "TORCH_INDEX": index}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return done, log.read_text().splitlines() if log.exists() else []


def test_a_machine_without_an_nvidia_driver_gets_the_cpu_build(tmp_path: Path) -> None:
    done, pip = _run(tmp_path, gpu=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("torch: 2.13.0, CPU build (no NVIDIA driver found")
    assert pip == ["install -q torch==2.13.0+cpu"]


def test_without_a_local_cpu_wheel_it_asks_pytorchs_cpu_index(tmp_path: Path) -> None:
    done, pip = _run(tmp_path, gpu=False, plus_cpu_found=False)
    assert done.returncode == 0, done.stderr
    assert pip == ["install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
                   "--extra-index-url https://pypi.org/simple"]


def test_a_machine_with_an_nvidia_driver_gets_the_cuda_build(tmp_path: Path) -> None:
    done, pip = _run(tmp_path, gpu=True)
    assert done.returncode == 0, done.stderr
    assert "NVIDIA driver found: GPU 0: NVIDIA H200" in done.stdout.splitlines()[0]
    assert pip == ["install -q torch==2.13.0"]


@pytest.mark.parametrize(("index", "gpu", "expected"), [
    ("cpu", True, "install -q torch==2.13.0+cpu"), ("cuda", False, "install -q torch==2.13.0"),
    ("https://download.pytorch.org/whl/cu128", False,
     "install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 --extra-index-url https://pypi.org/simple")])
def test_torch_index_chooses_instead(tmp_path: Path, index: str, gpu: bool, expected: str) -> None:
    done, pip = _run(tmp_path, gpu=gpu, index=index)
    assert done.returncode == 0, done.stderr
    assert pip == [expected]


def test_the_pinned_torch_already_installed_is_kept(tmp_path: Path) -> None:
    done, pip = _run(tmp_path, gpu=True, installed="2.13.0+cu130")
    assert done.returncode == 0 and pip == [] and "2.13.0+cu130 already installed (kept)" in done.stdout


def test_an_unknown_torch_index_is_refused(tmp_path: Path) -> None:
    done, pip = _run(tmp_path, gpu=False, index="nightly")
    assert done.returncode == 2 and pip == [] and "choose auto, cuda, cpu or an index URL" in done.stderr
