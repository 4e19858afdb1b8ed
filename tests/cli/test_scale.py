"""`earl-stream scale` against a real supervisor process: what it prints for a scale-down (who drains),
a scale-up (drains cancelled, workers to start), and one clear error for the trainer pool."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from earl_stream import protocol as P


@pytest.fixture()
def supervisor(tmp_path: Path) -> Iterator[str]:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "earl_stream", "supervisor", "--bind", "127.0.0.1:0",
                             "--ready-file", str(ready), f"run_dir={tmp_path}", "model.path=/nonexistent",
                             # the test's workers never heartbeat: a lease longer than two `scale` runs on a busy host
                             "supervisor.lease_s=300"],
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    yield json.loads(ready.read_text())["address"]
    proc.terminate()
    proc.wait(20)


def _scale(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "earl_stream", "scale", "--supervisor", address, *args],
                          capture_output=True, text=True, timeout=60)


def test_scale_command(supervisor: str) -> None:
    client = P.ControlClient(supervisor, timeout_s=10)
    ids = [client.call(P.Register(role=P.Role.ROLLOUT, shard_address=f"127.0.0.1:{9100 + i}")).worker_id
           for i in range(3)]
    client.call(P.RequestPrompts(worker_id=ids[0], max_groups=1, request_id="x"))  # rollout-0 holds a group
    out = _scale(supervisor, "--replicas", "1")
    assert out.returncode == 0, out.stderr
    assert "rollout pool: 1 wanted, 1 active" in out.stdout
    assert f"draining {ids[1]}, {ids[2]}:" in out.stdout  # the two holding nothing
    out = _scale(supervisor, "--replicas", "4")
    assert f"drain cancelled for {ids[1]}, {ids[2]}" in out.stdout or f"drain cancelled for {ids[2]}, {ids[1]}" in out.stdout
    assert "1 worker(s) to start" in out.stdout and "earl-stream worker --role rollout --supervisor" in out.stdout
    status = json.loads(client.call(P.StatusRequest()).status_json)
    assert status["pools"]["rollout"] == {"desired": 4, "active": 3, "draining": 0, "drained": 0}
    bad = _scale(supervisor, "--role", "trainer", "--replicas", "2")
    assert bad.returncode == 2 and "invalid choice: 'trainer'" in bad.stderr
    bad = _scale(supervisor, "--replicas", "-1")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "earl-stream scale: error: supervisor refused Scale: replicas=-1: a pool size is >= 0")
    client.close()
