"""`bench/fuzz.py --quick` against a live run: 1,000 malformed, truncated, oversized and replayed frames to
every port the run listens on (supervisor, shard nodes, metrics, OpenAI endpoints); no process dies, the
run trains on, the ledger adds up, and the supervisor counted the unsigned and replayed messages it refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.live
def test_a_live_run_survives_the_quick_fuzz(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz.py"), "--quick", "--json", str(out),
                           f"model.path={tiny_model_dir}", "rollout.workers=1", "trainer.groups_per_step=2",
                           "trainer.group_size=4", "rollout.groups_in_flight=2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["crashes"] == 0 and r["run_still_trains"] and r["ledger_adds_up"]
    assert {"zmq", "shard", "http"} <= set(r["port_kinds"]) and r["ports"] >= 5
    assert all(n >= 1000 for n in r["frames_per_port"].values()) and r["frames_sent"] >= 1000 * r["ports"]
    # ~1/6 of the supervisor's frames are replays and ~2/6 unsigned; under load ZMQ drops part of the burst
    # before the supervisor reads it (a CI run counted 89 replays refused), so these are lower bounds
    assert r["supervisor_refused"].get("unsigned", 0) > 100 and r["supervisor_refused"].get("replayed", 0) > 30
