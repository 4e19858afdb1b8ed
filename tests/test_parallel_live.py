"""Live sequence parallelism: a two-rank trainer under `earl-stream up` adopts a Ulysses plan
(dp=1, sp=2: a 1024-token design length does not fit its memory budget with data parallel alone)
at its first step boundary and trains every step through the real store with it. (Switching plans
back and forth on the same model objects, with the math unchanged, is
tests/test_parallel_equivalence.py; episodes of the tiny game are too short to grow live here.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.live
def test_two_rank_trainer_trains_with_ulysses_live(tmp_path: Path, tiny_model_dir: Path) -> None:
    summary = tmp_path / "s.json"
    steps = 4
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", str(steps), "--summary", str(summary),
           f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "trainer.groups_per_step=2",
           "trainer.group_size=4", "rollout.groups_in_flight=2", "rollout.workers=1", "supervisor.heartbeat_s=0.2",
           "trainer.nproc=2", "selector.initial_seq_len=1024", f"selector.trainer_memory_bytes={60 << 20}",
           "selector.reserve_bytes=0", "selector.lower_factor=0.01"]  # ~50-token episodes must not re-plan down
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(summary.read_text())["policy_version"] >= steps
    logs = tmp_path / "run" / "logs"
    text = "\n".join(p.read_text() for p in sorted(logs.glob("trainer*.log")))
    adopted = re.findall(r"adopted trainer plan v(\d+): (\w+) ", text)
    assert adopted and all(name == "sp2" for _, name in adopted), text[-3000:]
    trained = re.findall(r"step (\d+): loss", text)
    assert len(trained) >= 2 * steps, text[-3000:]  # both ranks, every step
