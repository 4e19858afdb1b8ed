"""Independent launch and failures, as real processes: a rollout worker killed with SIGKILL, the
supervisor killed and restarted from its state directory, and peers without the cluster secret."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from earl_stream import protocol as P
from earl_stream.errors import EarlError, ProtocolError
from earl_stream.security import SECRET_ENV, create_secret_file, load_secret

pytestmark = pytest.mark.slow


class Cluster:
    """Processes started the way a user starts them by hand: `earl-stream supervisor` / `worker`."""

    def __init__(self, tmp: Path, model_dir: Path, *overrides: str) -> None:
        self.tmp = tmp
        self.secret_file = create_secret_file(tmp / "secret")
        self.env = {**os.environ, SECRET_ENV: str(self.secret_file)}
        self.overrides = [f"model.path={model_dir}", f"run_dir={tmp / 'run'}", "trainer.groups_per_step=2",
                          "trainer.group_size=4", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2",
                          "supervisor.lease_s=3", *overrides]
        self.procs: dict[str, subprocess.Popen] = {}
        self.address = ""

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "earl_stream", *args], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_supervisor(self, port: int = 0) -> None:
        ready = self.tmp / "ready.json"
        ready.unlink(missing_ok=True)
        self.start("supervisor", "supervisor", "--bind", f"127.0.0.1:{port}", "--ready-file", str(ready),
                   "--state-dir", str(self.tmp / "state"), *self.overrides)
        wait_for(lambda: ready.exists(), 60, "the supervisor to listen")
        self.address = json.loads(ready.read_text())["address"]

    def worker(self, name: str, role: str) -> subprocess.Popen:
        return self.start(name, "worker", "--role", role, "--supervisor", self.address)

    def status(self) -> dict[str, Any]:
        client = P.ControlClient(self.address, timeout_s=5, secret=load_secret(str(self.secret_file)))
        try:
            return json.loads(client.call(P.StatusRequest()).status_json)
        finally:
            client.close()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = cond()
        except EarlError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture()
def cluster(tmp_path: Path, tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    c = Cluster(tmp_path, tiny_model_dir, "steps=40")
    yield c
    c.stop()


def test_rollout_worker_killed_and_supervisor_restarted(cluster: Cluster) -> None:
    cluster.start_supervisor()
    port = int(cluster.address.rsplit(":", 1)[1])
    victim = cluster.worker("rollout-a", "rollout")
    cluster.worker("rollout-b", "rollout")
    trainer = cluster.worker("trainer", "trainer")
    wait_for(lambda: cluster.status()["policy_version"] >= 3, 180, "three training steps")
    # a rollout worker dies without warning: its samples are lost, its prompts re-issued
    wait_for(lambda: any(w["stats"].get("episodes", 0) > 0 for w in cluster.status()["workers"]
                         if w["role"] == "rollout"), 60, "episodes")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    s = wait_for(lambda: (st := cluster.status()) and any(not w["alive"] for w in st["workers"]) and st, 30,
                 "the supervisor to declare the worker dead")
    assert s["prompts_reissued"] >= 1
    # the supervisor dies and comes back on the same port from its state directory
    cluster.procs["supervisor"].send_signal(signal.SIGKILL)
    cluster.procs["supervisor"].wait()
    version_before = s["policy_version"]
    time.sleep(1.0)
    cluster.start_supervisor(port)
    s = wait_for(lambda: (st := cluster.status()) and st["policy_version"] >= version_before + 2 and st, 180,
                 "training to continue after the supervisor restart")
    assert trainer.wait(240) == 0
    s = cluster.status()
    assert s["policy_version"] == 40
    waiting = s["samples_in_store"]
    assert s["samples_produced"] == s["samples_consumed"] + s["samples_lost"] + s["samples_stale"] + waiting
    # late rows of a worker declared dead are counted as duplicates and never trained
    assert s["samples_consumed"] == 40 * 2 * 4


def test_peer_without_the_secret_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_supervisor()
    wrong = create_secret_file(tmp_path / "other")
    for secret in (None, load_secret(str(wrong))):
        client = P.ControlClient(cluster.address, timeout_s=5, secret=secret)
        with pytest.raises(ProtocolError, match="refused|authentication"):
            client.call(P.Register(role=P.Role.ROLLOUT, shard_address="x:1"))
        client.close()
    assert cluster.status()["workers"] == []  # it learned nothing and registered nothing
    log = (cluster.tmp / "supervisor.log").read_text()
    assert "refused a control message without the cluster secret" in log
