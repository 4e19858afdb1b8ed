"""`earl-stream worker --role trainer --nproc N --restart R` (cli/worker.py): a rank killed with SIGKILL is a
failure of the pool, also when the pool has one rank (it used to end the pool's watch loop as if the pool had
finished: `up --restart` then exited 0 mid-run, found by bench/chaos.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import wait_for

from earl_stream import protocol as P
from earl_stream.security.secret import create_secret_file, load_secret

pytestmark = pytest.mark.slow


def _trainers(address: str, secret: bytes | None) -> list[dict]:
    client = P.ControlClient(address, timeout_s=5, secret=secret)
    try:
        return [w for w in json.loads(client.call(P.StatusRequest()).status_json)["workers"]
                if w["role"] == "trainer" and w["alive"]]
    finally:
        client.close()


@pytest.mark.faults
def test_a_pool_of_one_whose_rank_is_killed_stops_with_an_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    secret_file = create_secret_file(tmp_path / "secret")
    secret = load_secret(str(secret_file))
    ready = tmp_path / "ready.json"
    sup = subprocess.Popen([sys.executable, "-m", "earl_stream", "supervisor", "--bind", "127.0.0.1:0", "--ready-file",
                            str(ready), "--secret-file", str(secret_file), f"run_dir={tmp_path / 'run'}",
                            f"model.path={tiny_model_dir}"], stderr=subprocess.DEVNULL)
    pool = None
    try:
        wait_for(ready.exists, 60, "the supervisor")
        address = json.loads(ready.read_text())["address"]
        pool = subprocess.Popen([sys.executable, "-m", "earl_stream", "worker", "--role", "trainer", "--supervisor",
                                 address, "--secret-file", str(secret_file), "--nproc", "1", "--restart", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = wait_for(lambda: _trainers(address, secret), 120, "the rank to register")[0]
        subprocess.run(["kill", "-9", str(first["pid"])], check=True)
        again = wait_for(lambda: [w for w in _trainers(address, secret) if w["pid"] != first["pid"]], 120,
                         "the restarted rank to register")
        subprocess.run(["kill", "-9", str(again[0]["pid"])], check=True)
        started = time.monotonic()
        out = pool.communicate(timeout=60)[0]
        assert pool.returncode == 2, out[-3000:]
        assert "restarting the trainer pool (1 of 1)" in out
        assert "was killed by SIGKILL; the trainer pool stopped after 1 restarts" in out
        assert time.monotonic() - started < 30
    finally:
        for proc in (pool, sup):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
