"""Runs you can find and stop: live-run commands default to the local run (runs/latest) when no --supervisor
is given, and `earl-stream stop` ends a run as Ctrl-C on its `up` does (drain, checkpoint, summary, exit 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import wait_for

from earl_stream import protocol as P
from earl_stream.cli.local_run import UP_RECORD, RunNotFound, find_run
from earl_stream.errors import EarlError
from earl_stream.security.secret import load_secret

CLI = [sys.executable, "-m", "earl_stream"]


def _cli(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k != "EARL_STREAM_SECRET_FILE"})


def _ready(run_dir: Path, address: str = "tcp://127.0.0.1:1") -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "supervisor.json").write_text(json.dumps({"address": address, "metrics_address": "127.0.0.1:2"}))
    return run_dir


@pytest.mark.parametrize("command", [("status",), ("stop",), ("scale", "--replicas", "1"), ("keys", "show")])
def test_no_run_found_is_one_clear_line(tmp_path: Path, command: tuple[str, ...]) -> None:
    proc = _cli(tmp_path, *command)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "runs/latest/supervisor.json" in lines[0] and "--supervisor" in lines[0]


def test_run_given_that_does_not_exist_is_named(tmp_path: Path) -> None:
    proc = _cli(tmp_path, "status", "--run-dir", str(tmp_path / "elsewhere"))
    assert proc.returncode == 2 and f"{tmp_path / 'elsewhere'}/supervisor.json" in proc.stderr


def test_find_run_prefers_this_directory_then_runs_latest_then_the_newest(tmp_path: Path) -> None:
    with pytest.raises(RunNotFound):
        find_run(where=tmp_path)
    _ready(tmp_path / "runs" / "old", "tcp://127.0.0.1:10")
    time.sleep(0.01)
    _ready(tmp_path / "runs" / "new", "tcp://127.0.0.1:11")
    os.utime(tmp_path / "runs" / "old" / "supervisor.json", (0, 0))
    assert find_run(where=tmp_path).address == "tcp://127.0.0.1:11"
    _ready(tmp_path / "runs" / "latest", "tcp://127.0.0.1:12")
    assert find_run(where=tmp_path).address == "tcp://127.0.0.1:12"
    assert find_run(where=tmp_path / "runs" / "old").address == "tcp://127.0.0.1:10"
    assert find_run(tmp_path / "runs" / "new").run_dir == (tmp_path / "runs" / "new").resolve()


def test_a_stale_up_record_is_ignored(tmp_path: Path) -> None:
    run_dir = _ready(tmp_path / "run")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / UP_RECORD).write_text(json.dumps({"pid": dead.pid, "summary": str(run_dir / "summary.json")}))
    assert find_run(run_dir).up_pid is None
    (run_dir / "summary.json").write_text("{}")
    proc = _cli(tmp_path, "stop", str(run_dir))
    assert proc.returncode == 2 and "already ended" in proc.stderr and "Traceback" not in proc.stderr


def _policy_version(run_dir: Path) -> int:
    address = json.loads((run_dir / "supervisor.json").read_text())["address"]
    client = P.ControlClient(address, timeout_s=5, secret=load_secret(str(run_dir / "secret")))
    try:
        return int(json.loads(client.call(P.StatusRequest()).status_json)["policy_version"])
    finally:
        client.close()


@pytest.mark.live
def test_status_and_stop_find_the_run_up_started_here(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`up` in a directory; there `earl-stream status` and `earl-stream stop` need no flag; `up` drains,
    checkpoints, writes its summary and exits 0."""
    run_dir = tmp_path / "runs" / "latest"
    up = subprocess.Popen([*CLI, "up", "--steps", "0", f"model.path={tiny_model_dir}", "trainer.groups_per_step=2",
                           "trainer.group_size=4", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2"],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def trained() -> bool:
            if up.poll() is not None or not (run_dir / "supervisor.json").exists():
                return up.poll() is not None
            try:
                return _policy_version(run_dir) >= 1
            except (EarlError, OSError, ValueError):  # a ready file being written, a supervisor starting
                return False

        wait_for(trained, 240, "the run to train a step")
        assert up.poll() is None
        status = _cli(tmp_path, "status")
        assert status.returncode == 0 and status.stdout.startswith("step "), status.stderr
        assert "trainer" in status.stdout
        stop = _cli(tmp_path, "stop", timeout=300)
        assert stop.returncode == 0, stop.stderr[-3000:]
        assert f"summary in {run_dir.resolve() / 'summary.json'}" in stop.stdout
        out = up.communicate(timeout=60)[0]
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0, out[-3000:]
    assert "stopped (interrupted)" in out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 1
    assert (run_dir / "checkpoints" / "latest").exists()
    assert not (run_dir / UP_RECORD).exists()


def test_a_run_started_by_hand_is_told_to_finish_by_its_supervisor(tmp_path: Path) -> None:
    """No `up` runs it (no RUN_DIR/up.json): `stop RUN_DIR` asks the supervisor to finish the run, and
    `status --run-dir RUN_DIR` finds that supervisor by its ready file."""
    run_dir = tmp_path / "run"
    sup = subprocess.Popen([*CLI, "supervisor", "--bind", "127.0.0.1:0", "--ready-file", str(run_dir / "supervisor.json"),
                            f"run_dir={run_dir}", "model.path=/nonexistent"], stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: sup.poll() is not None or (run_dir / "supervisor.json").exists(), 60, "the supervisor")
        stop = _cli(tmp_path, "stop", str(run_dir))
        assert stop.returncode == 0 and "told the supervisor" in stop.stdout, stop.stderr[-3000:]
        status = _cli(tmp_path, "status", "--json", "--run-dir", str(run_dir))
        assert status.returncode == 0 and json.loads(status.stdout)["finished"] is True, status.stderr[-3000:]
    finally:
        sup.terminate()
        sup.wait(20)
