"""A trainer pool with more ranks on a host than the host has GPUs, on a real GPU host: `up` stops at once
with the reason (the counts and the ways out), not with NCCL's 'invalid usage' from two ranks on one GPU.

Needs a CUDA GPU (marker `gpu`); skipped where torch sees none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_pool_with_more_ranks_than_gpus_stops_with_the_reason(tmp_path: Path, tiny_model_dir: Path) -> None:
    gpus = torch.cuda.device_count()
    proc = subprocess.run([sys.executable, "-m", "earl_stream", "up", "--steps", "2", f"trainer.nproc={gpus + 1}",
                           f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert (f"trainer.device=auto: {gpus + 1} ranks of this pool run on this host but torch sees {gpus} CUDA device"
            in out), out[-3000:]
    assert "NCCL" not in out.replace("NCCL refuses", ""), out[-3000:]
