"""`earl-stream doctor` on a real GPU host: every GPU with its memory, CUDA devices configured and resolved, and a
trainer pool with more ranks than GPUs refused as `up` refuses it.

Needs a CUDA GPU (marker `gpu`); skipped where torch sees none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _doctor(tmp_path: Path, *args: str) -> tuple[int, dict[str, dict]]:
    proc = subprocess.run([sys.executable, "-m", "earl_stream", "doctor", "--json", f"run_dir={tmp_path / 'run'}", *args],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    return proc.returncode, {f["name"]: f for f in report["findings"]}


def test_each_gpu_with_its_memory_and_cuda_devices_resolve(tmp_path: Path) -> None:
    code, found = _doctor(tmp_path, "trainer.device=cuda", "rollout.device=cuda")
    gpus = torch.cuda.device_count()
    assert code == 0, found
    assert f"{gpus} CUDA device(s) visible" in found["torch"]["detail"] and "CUDA" in found["torch"]["detail"]
    for i in range(gpus):
        assert torch.cuda.get_device_name(i) in found[f"GPU {i}"]["detail"] and "GiB free" in found[f"GPU {i}"]["detail"]
    assert found["trainer.device"]["detail"] == "cuda -> cuda" and found["rollout.device"]["verdict"] == "ok"


def test_more_trainer_ranks_than_gpus_cannot_start(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    code, found = _doctor(tmp_path, f"trainer.nproc={gpus + 1}")
    assert code == 1 and found["trainer.device"]["verdict"] == "fail"
    assert f"torch sees {gpus} CUDA device" in found["trainer.device"]["detail"]
