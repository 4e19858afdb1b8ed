"""No cluster secret on a worker's host (earl_stream/security/keys.py): the worker key alone opens what a worker
serves (data plane, environment servers, agent keys), never what an operator does (scale, stop, env attach,
keys revoke); a revoked worker key or worker id is refused by a real supervisor from its next message on
(supervisor/revocation.py); and the local launcher hands workers the worker key, not the secret."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cluster import Cluster, control_call

from earl_stream import protocol as P
from earl_stream.env.server import EnvServer, RemoteEnv
from earl_stream.errors import ConfigError, EnvError, ProtocolError, StoreError
from earl_stream.security.keys import (
    KeyRole,
    Plane,
    agent_key,
    check_agent_key,
    is_cluster_secret,
    parse_role_token,
    plane_key,
    readonly_token,
    role_of,
    role_token,
)
from earl_stream.security.secret import SECRET_ENV, load_secret
from earl_stream.store.client import ShardClient
from earl_stream.store.node import ShardNode

SECRET = b"0123456789abcdef" * 4
OTHER = b"fedcba9876543210" * 4


def test_a_worker_key_derives_what_a_worker_serves_and_nothing_above_it() -> None:
    worker = role_token(SECRET, KeyRole.WORKER)
    assert SECRET not in worker and role_of(worker) is KeyRole.WORKER
    for plane in Plane:  # the same key from the secret and from the worker key: no secret on a worker's host
        assert plane_key(worker, plane) == plane_key(SECRET, plane) != plane_key(role_token(OTHER, KeyRole.WORKER), plane)
    assert readonly_token(worker) == role_token(SECRET, KeyRole.READONLY)  # it serves the metrics that key scrapes
    for above in (role_token(SECRET, KeyRole.OPERATOR), role_token(SECRET, KeyRole.READONLY)):
        with pytest.raises(ConfigError, match="takes the worker key or the cluster secret"):
            plane_key(above, Plane.DATA)
    # agent keys minted by a worker hold for a holder of the secret, and the other way round
    assert check_agent_key(SECRET, agent_key(worker, "g-1", 60)) == "g-1"
    assert check_agent_key(worker, agent_key(SECRET, "g-2", 60)) == "g-2"
    # a worker checks a bearer token that claims to be the secret without holding the secret
    assert is_cluster_secret(worker, SECRET) and not is_cluster_secret(worker, OTHER)
    assert not is_cluster_secret(worker, worker)
    # a new generation changes the control-plane key, not the planes' keys (running shard nodes keep theirs)
    renewed = role_token(SECRET, KeyRole.WORKER, 1)
    assert renewed != worker and plane_key(renewed, Plane.DATA) == plane_key(worker, Plane.DATA)
    assert role_token(SECRET, KeyRole.OPERATOR, 1) != role_token(SECRET, KeyRole.OPERATOR)
    with pytest.raises(ConfigError, match="malformed worker key"):
        parse_role_token(worker.rpartition(b":")[0])  # a worker key without its plane part


def test_the_data_plane_takes_the_worker_key_and_refuses_a_wrong_one() -> None:
    data = np.arange(16, dtype=np.float32)
    with ShardNode(secret=SECRET, frame_timeout_s=5.0) as node:  # a node of a worker given the secret (old setup)
        node.put("k", data)
        with ShardClient(secret=role_token(SECRET, KeyRole.WORKER), timeout_s=5.0) as client:
            (arr,) = client.pull(node.address, [("k", 2, 6)])
            np.testing.assert_array_equal(arr, data[2:6])
        with ShardClient(secret=role_token(OTHER, KeyRole.WORKER), timeout_s=5.0) as wrong, \
                pytest.raises(StoreError, match="refused our credentials"):
            wrong.pull(node.address, [("k", 0, 1)])
        with pytest.raises(ConfigError, match="readonly key opens no data plane"):
            ShardClient(secret=role_token(SECRET, KeyRole.READONLY))
    with ShardNode(secret=role_token(SECRET, KeyRole.WORKER), frame_timeout_s=5.0) as node, \
            ShardClient(secret=SECRET, timeout_s=5.0) as client:  # a worker's node, pulled by a holder of the secret
        node.put("k", data)
        (arr,) = client.pull(node.address, [("k", 0, 3)])
        np.testing.assert_array_equal(arr, data[:3])


def test_an_environment_server_takes_the_worker_key_and_refuses_a_wrong_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "worker.key"

    async def go() -> None:
        server = EnvServer("calculator", {"max_turns": 2}, secret=SECRET)
        stop = asyncio.Event()
        serving = asyncio.create_task(server.serve(stop))
        try:
            key_file.write_bytes(role_token(SECRET, KeyRole.WORKER))
            assert "km" in await RemoteEnv(server.address, timeout_s=10).reset(1)  # the observation: it answered
            key_file.write_bytes(role_token(OTHER, KeyRole.WORKER))
            with pytest.raises(EnvError, match="authentication failed"):
                await RemoteEnv(server.address, timeout_s=10).reset(1)
        finally:
            stop.set()
            await serving

    monkeypatch.setenv(SECRET_ENV, str(key_file))
    asyncio.run(go())


@pytest.mark.slow
def test_a_rollout_workers_key_cannot_scale_stop_attach_or_revoke(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_supervisor()
        secret = load_secret(str(cluster.secret_file))
        assert secret is not None
        worker, operator = role_token(secret, KeyRole.WORKER), role_token(secret, KeyRole.OPERATOR)
        rollout = cluster.call(worker, P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:1"))
        assert isinstance(rollout, P.Registered)
        for msg in (P.Scale(replicas=3), P.EnvAttach(spec="tictactoe", name="t2"), P.EnvDetach(name="tictactoe"),
                    P.RevokeKey(target="worker"), P.RevokeKey(target=rollout.worker_id)):
            with pytest.raises(ProtocolError, match="not allowed with the worker key"):
                cluster.call(worker, msg)
        # stop: an operator's (no worker id) or one claimed for a rollout worker is refused with the worker key
        for who in ("", rollout.worker_id, "trainer-99"):
            with pytest.raises(ProtocolError, match="stopping the run needs the operator key"):
                cluster.call(worker, P.Finished(worker_id=who, reason="x"))
        keys = cluster.cli("keys", "revoke", "worker", "--supervisor", cluster.address, "--secret-file",
                    str(_write(tmp_path / "w.key", worker)))
        assert keys.returncode == 2 and "needs the operator key" in keys.stderr, keys.stderr
        status = cluster.status()
        assert not status["finished"] and status["pools"]["rollout"]["desired"] is None and len(status["envs"]) == 1
        assert status["revoked_workers"] == [] and not (tmp_path / "state" / "keys" / "revoked.json").exists()
        # the trainer's end of the run after its last step: a live trainer rank's Finished, with the worker key
        trainer = cluster.call(worker, P.Register(role=P.Role.TRAINER, rank=0, shard_address="127.0.0.1:2"))
        assert isinstance(cluster.call(worker, P.Finished(worker_id=trainer.worker_id, reason="done")),  # type: ignore[attr-defined]
                          P.Ack)
        assert cluster.status()["finished"]
        assert isinstance(cluster.call(operator, P.Finished(reason="stop")), P.Ack)  # the operator stops
    finally:
        cluster.stop()


def _write(path: Path, key: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(key)
    path.chmod(0o600)
    return path


@pytest.mark.slow
def test_a_revoked_worker_key_is_refused_at_its_next_message(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_supervisor()
        secret = load_secret(str(cluster.secret_file))
        assert secret is not None
        old = role_token(secret, KeyRole.WORKER)
        key_file = _write(tmp_path / "state" / "keys" / "worker", old)  # where `up`'s launchers point workers
        reg = cluster.call(old, P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:1"))
        beat = P.Heartbeat(worker_id=reg.worker_id)  # type: ignore[attr-defined]
        stale = P.ControlClient(cluster.address, timeout_s=10, secret=old)  # a leaked copy of the old key
        reloading = P.ControlClient(cluster.address, timeout_s=10, secret=old, key_file=str(key_file))  # up's worker
        try:
            assert isinstance(stale.call(beat), P.HeartbeatReply)
            out = cluster.cli("keys", "revoke", "worker", "--supervisor", cluster.address, "--secret-file",
                       str(_write(tmp_path / "op.key", role_token(secret, KeyRole.OPERATOR))))
            assert out.returncode == 0 and "generation 1" in out.stdout, out.stderr
            with pytest.raises(ProtocolError, match="authentication failed"):
                stale.call(beat)  # its very next message
            new = role_token(secret, KeyRole.WORKER, 1)
            assert key_file.read_bytes().strip() == new and key_file.stat().st_mode & 0o777 == 0o600
            assert isinstance(reloading.call(beat), P.HeartbeatReply) and reloading.secret == new
            assert isinstance(cluster.call(new, beat), P.HeartbeatReply)
        finally:
            stale.close()
            reloading.close()
        # `keys derive` with the secret of a run's directory (RUN_DIR/secret, as `up` keeps it) derives the current
        # generation
        derived = cluster.cli("keys", "derive", "worker", "--secret-file",
                       str(_write(tmp_path / "state" / "secret", secret)))
        assert derived.returncode == 0 and derived.stdout.strip() == new.decode(), derived.stderr
        # a restarted supervisor keeps refusing the old key
        sup = cluster.procs.pop("supervisor")
        sup.terminate()
        sup.wait(30)
        cluster.start_supervisor()
        with pytest.raises(ProtocolError, match="authentication failed"):
            cluster.call(old, beat)
        assert isinstance(cluster.call(new, P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:3")),
                          P.Registered)
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_revoked_worker_id_is_evicted_and_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_supervisor()
        secret = load_secret(str(cluster.secret_file))
        assert secret is not None
        worker, operator = role_token(secret, KeyRole.WORKER), role_token(secret, KeyRole.OPERATOR)
        ids = [cluster.call(worker, P.Register(role=P.Role.ROLLOUT, shard_address=f"127.0.0.1:{i + 1}"))
               .worker_id for i in range(2)]  # type: ignore[attr-defined]
        reply = cluster.call(operator, P.RevokeKey(target=ids[0]))
        assert isinstance(reply, P.RevokeReply) and "evicted" in reply.message
        for msg in (P.Heartbeat(worker_id=ids[0]), P.Register(role=P.Role.ROLLOUT, worker_id=ids[0]),
                    P.RequestPrompts(worker_id=ids[0])):
            with pytest.raises(ProtocolError, match=f"worker {ids[0]} is revoked"):
                cluster.call(worker, msg)
        assert isinstance(cluster.call(worker, P.Heartbeat(worker_id=ids[1])), P.HeartbeatReply)
        status = cluster.status()
        assert status["revoked_workers"] == [ids[0]]
        assert {w["id"]: w["alive"] for w in status["workers"]}[ids[0]] is False
        with pytest.raises(ProtocolError, match="nothing to revoke named 'rollout-77'"):
            cluster.call(operator, P.RevokeKey(target="rollout-77"))
        assert "worker " + ids[0] + " is revoked" in (tmp_path / "supervisor.log").read_text()
    finally:
        cluster.stop()


def test_the_local_launcher_gives_workers_the_worker_key_not_the_secret(tmp_path: Path) -> None:
    from earl_stream.cli.launchers import RunSpec
    from earl_stream.cli.launchers.local import LocalLauncher
    from earl_stream.cli.up import _worker_key
    from earl_stream.config import load_config
    from earl_stream.security.secret import create_secret_file

    run_dir = tmp_path / "run"
    secret_file = create_secret_file(run_dir / "secret")
    secret = load_secret(str(secret_file))
    assert secret is not None
    cfg = load_config(None, [f"run_dir={run_dir}"])
    assert _worker_key(run_dir, secret, resume=False) == (run_dir / "keys" / "worker").resolve()
    (run_dir / "logs").mkdir()
    launcher = LocalLauncher(RunSpec(cfg, run_dir / "config.yaml", secret_file))
    child = launcher.start_rollout_worker(0, "tcp://127.0.0.1:9")  # a real process (it waits for a supervisor)
    try:
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{child.proc.pid}/environ").read_text().split("\0") if "=" in item)
    finally:
        launcher.stop()
    given = Path(environ[SECRET_ENV])
    assert given.resolve() == (run_dir / "keys" / "worker").resolve() and given.stat().st_mode & 0o777 == 0o600
    assert role_of(given.read_bytes().strip()) is KeyRole.WORKER and secret not in given.read_bytes()
    assert not any(str(secret_file) in v or secret.decode() in v for v in environ.values())
    assert launcher._env()[SECRET_ENV] == str(secret_file)  # the supervisor's environment: the secret


@pytest.mark.live
@pytest.mark.slow
def test_up_trains_on_through_a_revoked_worker_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The workers `up` started hold the worker key only; `keys revoke worker` locks the old key out, and they
    take the new one from RUN_DIR/keys/worker and train on: no worker dies, no step is lost."""
    import json
    import os

    from cluster import wait_for

    from earl_stream.security.secret import create_secret_file

    run, secret_file = tmp_path / "run", create_secret_file(tmp_path / "secret")
    env = {**os.environ, SECRET_ENV: str(secret_file)}
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "0", f"model.path={tiny_model_dir}", f"run_dir={run}",
           "rollout.workers=1", "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2",
           "supervisor.heartbeat_s=0.2"]
    with open(tmp_path / "up.log", "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def status() -> dict:
        try:
            address = json.loads((run / "supervisor.json").read_text())["address"]
        except (OSError, ValueError, KeyError):
            return {}
        out = subprocess.run([sys.executable, "-m", "earl_stream", "status", "--json", "--supervisor", address],
                             env=env, capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else {}

    try:
        before = wait_for(lambda: (s := status()) and s["policy_version"] >= 2 and s, 300, "two training steps")
        old = (run / "keys" / "worker").read_bytes().strip()
        assert role_of(old) is KeyRole.WORKER
        revoked = subprocess.run([sys.executable, "-m", "earl_stream", "keys", "revoke", "worker", "--supervisor",
                                  before["address"]], env=env, capture_output=True, text=True, timeout=60)
        assert revoked.returncode == 0 and "generation 1" in revoked.stdout, revoked.stderr
        with pytest.raises(ProtocolError, match="authentication failed"):
            control_call(before["address"], old, P.Heartbeat(worker_id="rollout-0"))
        after = wait_for(lambda: (s := status()) and s["policy_version"] >= before["policy_version"] + 2 and s, 300,
                         "two more training steps after the revocation")
        assert all(w["alive"] for w in after["workers"]) and len(after["workers"]) == len(before["workers"])
        assert after["samples_lost"] == before["samples_lost"] == 0
    finally:
        up.terminate()
        up.wait(240)  # the trainer checkpoints before it stops
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "refused our key: using the new one" in logs
