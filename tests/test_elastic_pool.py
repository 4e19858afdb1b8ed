"""The elastic rollout pool as real processes: a run started by hand (supervisor, two rollout workers,
a trainer) is scaled 2 -> 1 while it trains: the drained worker takes no new prompts, stays until its
samples are trained and released, then exits 0; scaled 1 -> 2, the supervisor asks for one worker,
which joins and takes prompts. Nothing is lost or trained twice."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from cluster import Cluster, wait_for

from earl_stream import protocol as P
from earl_stream.security.secret import load_secret

pytestmark = pytest.mark.slow


def _scale(cluster: Cluster, replicas: int) -> P.ScaleReply:
    client = P.ControlClient(cluster.address, timeout_s=10, secret=load_secret(str(cluster.secret_file)))
    try:
        reply = client.call(P.Scale(role=P.Role.ROLLOUT, replicas=replicas))
    finally:
        client.close()
    assert isinstance(reply, P.ScaleReply)
    return reply


@pytest.mark.live
def test_scale_down_drains_and_scale_up_joins(tmp_path: Path, tiny_model_dir: Path) -> None:
    # a lease long enough that a worker starved of CPU while the new one loads torch is not declared dead
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", "trainer.checkpoint_every=3", "supervisor.lease_s=20")
    try:
        cluster.start_supervisor()
        workers = {"rollout-a": cluster.worker("rollout-a", "rollout"), "rollout-b": cluster.worker("rollout-b", "rollout")}
        trainer = cluster.worker("trainer", "trainer")
        wait_for(lambda: cluster.status()["policy_version"] >= 1, 180, "a first training step")
        reply = _scale(cluster, 1)
        assert len(reply.draining) == 1 and reply.active == 1 and reply.to_start == 0
        leaving = reply.draining[0]
        seen = cluster.status()
        pid = next(w["pid"] for w in seen["workers"] if w["id"] == leaving)
        proc = next(p for p in workers.values() if p.pid == pid)
        assert seen["pools"]["rollout"]["desired"] == 1
        drained_flags = [w["draining"] or w["drained"] for w in seen["workers"] if w["id"] == leaving]
        assert drained_flags == [True]
        assert proc.wait(120) == 0, "the drained worker exits cleanly"
        s = cluster.status()
        gone = next(w for w in s["workers"] if w["id"] == leaving)
        assert gone["drained"] and not gone["alive"] and not gone["draining"]
        assert s["samples_lost"] == 0
        # scale up again: the supervisor asks for one worker; a launcher (here: the test) starts it
        reply = _scale(cluster, 2)
        assert reply.to_start == 1 and reply.undrained == []
        cluster.worker("rollout-c", "rollout")
        known = {p.pid for p in workers.values()}
        s = wait_for(lambda: (st := cluster.status()) and any(w["alive"] and w["pid"] not in known and w["stats"].get(
            "episodes", 0) > 0 for w in st["workers"]) and st, 300, "the new worker to play episodes")
        assert s["pools"]["rollout"] == {"desired": 2, "active": 2, "draining": 0, "drained": 1}
        start = s["policy_version"]
        s = wait_for(lambda: (st := cluster.status()) and st["policy_version"] >= start + 3 and st, 300,
                     "three more training steps with the new worker")
        assert trainer.poll() is None
        # one snapshot of the ledger: nothing lost, nothing seen twice, every sample accounted for
        assert s["samples_lost"] == 0 and s["duplicates_detected"] == 0
        assert s["samples_produced"] == (s["samples_consumed"] + s["samples_stale"] + s["samples_in_store"]
                                         + s["samples_claimed"])
        assert s["samples_consumed"] % (2 * 4) == 0  # whole steps, none trained twice
        log = (tmp_path / "rollout-a.log").read_text() + (tmp_path / "rollout-b.log").read_text()
        assert "draining: no new prompts" in log and "drained: every sample it produced" in log
        assert "drain cancelled" not in log
    finally:
        cluster.stop()


@pytest.mark.live
def test_a_worker_stopped_by_its_host_drains_with_drain_on_term(tmp_path: Path, tiny_model_dir: Path) -> None:
    """What a Kubernetes scale-down (or a preempted node) does: SIGTERM to a worker started with
    --drain-on-term. It drains (no new prompts), stays until its samples are trained and released, exits 0;
    nothing is lost or played again, and the run goes on with the other worker."""
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", "trainer.checkpoint_every=3", "supervisor.lease_s=20")
    try:
        cluster.start_supervisor()
        leaving = cluster.worker("rollout-a", "rollout", "--drain-on-term")
        cluster.worker("rollout-b", "rollout")
        cluster.worker("trainer", "trainer")
        wait_for(lambda: cluster.status()["policy_version"] >= 2, 180, "two training steps")
        leaving.send_signal(signal.SIGTERM)
        assert leaving.wait(180) == 0, (tmp_path / "rollout-a.log").read_text()[-2000:]
        s = cluster.status()
        gone = next(w for w in s["workers"] if w["pid"] == leaving.pid)
        assert gone["drained"] and not gone["alive"]
        start = s["policy_version"]
        s = wait_for(lambda: (st := cluster.status()) and st["policy_version"] >= start + 2 and st, 180,
                     "two more steps with the other worker")
        assert s["samples_lost"] == 0 and s["prompts_reissued"] == 0 and s["duplicates_detected"] == 0
        log = (tmp_path / "rollout-a.log").read_text()
        assert "received SIGTERM: draining" in log and "drained: every sample it produced" in log
    finally:
        cluster.stop()
