"""A tiny mixture-of-experts model end to end: `up` with a Qwen3-MoE directory, routing replay on, two
trainer ranks (dp/fsdp plans: the selector refuses tp and sp for expert blocks), trains its steps and
exports `earl_trainer_routing_mismatch` per rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.live
def test_up_trains_a_tiny_moe_with_routing_replay(tmp_path: Path) -> None:
    from earl_stream.model.tiny_moe import init_moe_model

    model_dir = init_moe_model(tmp_path / "moe", family="qwen3_moe", experts=4, top_k=2)
    run, summary = tmp_path / "run", tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary),
           f"model.path={model_dir}", f"run_dir={run}", "trainer.groups_per_step=2", "trainer.group_size=4",
           "trainer.nproc=2", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2", "algo.routing_replay=rollout"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == 2, s
    logs = "".join(p.read_text(errors="replace") for p in run.rglob("*.log"))
    assert "recording routed experts per token" in logs  # the rollout engine recorded routing
