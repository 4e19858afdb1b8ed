"""The vLLM/SGLang engines' weight directories in RAM: named by their owner's pid, and the ones a killed
process left behind are removed by the next engine that starts (a kill -9 runs no finaliser)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from earl_stream.workers.engines.model_files import shm_root, sweep_dead_roots


def test_directories_of_dead_owners_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # exited: its pid names no live process (unless reused within this test)
    left = tmp_path / f"earl-vllm-{dead_pid}-abc123"
    (left / "v3").mkdir(parents=True)
    (left / "v3" / "model.safetensors").write_bytes(b"\0" * 1024)
    mine = tmp_path / f"earl-vllm-{os.getpid()}-def456"
    mine.mkdir()
    other = tmp_path / "earl-vllm-legacyname"  # no owner pid: not ours to judge
    other.mkdir()
    assert sweep_dead_roots(tmp_path) == [left]
    assert not left.exists() and mine.exists() and other.exists()


def test_shm_root_names_its_owner() -> None:
    root = shm_root()
    try:
        assert root.is_dir() and root.name.startswith(f"earl-vllm-{os.getpid()}-")
    finally:
        root.rmdir()
