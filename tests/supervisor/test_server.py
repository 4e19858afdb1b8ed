"""The supervisor as a real process: registration, status, and garbage on its port."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from earl_stream import protocol as P
from earl_stream.errors import ProtocolError


@pytest.fixture()
def supervisor(tmp_path: Path) -> Iterator[str]:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "earl_stream", "supervisor", "--bind", "127.0.0.1:0",
                             "--ready-file", str(ready), f"run_dir={tmp_path}", "model.path=/nonexistent"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield json.loads(ready.read_text())["address"]
    proc.terminate()
    assert proc.wait(20) == 0


def test_register_heartbeat_status(supervisor: str) -> None:
    client = P.ControlClient(supervisor, timeout_s=10)
    reg = client.call(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:9"))
    assert reg.worker_id.startswith("rollout") and json.loads(reg.config_json)["envs"][0]["spec"] == "tictactoe"
    hb = client.call(P.Heartbeat(worker_id=reg.worker_id))
    assert hb.known and hb.policy_version == 0 and not hb.stop
    assert not client.call(P.Heartbeat(worker_id="nobody")).known
    prompts = client.call(P.RequestPrompts(worker_id=reg.worker_id, max_groups=2)).prompts
    assert len(prompts) == 2
    status = json.loads(client.call(P.StatusRequest()).status_json)
    for key in ("samples_produced", "samples_consumed", "samples_lost", "prompts_reissued", "duplicates_detected"):
        assert status[key] == 0
    assert status["workers"][0]["id"] == reg.worker_id
    assert status["win_rate_last"] is None and status["win_rate_stderr_last"] is None and status["groups_last"] == 0


def test_garbage_does_not_stop_the_supervisor(supervisor: str) -> None:
    host, port = supervisor.removeprefix("tcp://").rsplit(":", 1)
    for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 10_000):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            time.sleep(0.05)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(supervisor)
    sock.send_multipart([b"", b"not msgpack at all"])
    assert sock.poll(5000)
    reply = P.decode(sock.recv_multipart()[-1])
    assert isinstance(reply, P.ErrorReply) and "not an earl_stream control message" in reply.message
    sock.close(0)
    with pytest.raises(ProtocolError, match="version"):
        P.decode(P.encode(P.StatusRequest(v=99)))
    client = P.ControlClient(supervisor, timeout_s=10)
    assert "policy_version" in json.loads(client.call(P.StatusRequest()).status_json)


def test_only_trainer_rank_0_moves_the_policy_version_by_heartbeat(supervisor: str) -> None:
    """Rank 0's node holds the weights manifest; a rank > 0 that reports a published version (a moment
    ahead of or behind rank 0 around a publish) must not point the rollout workers at its own node, which
    serves only its pieces (a 2-rank Ray run loaded an empty manifest that way)."""
    client = P.ControlClient(supervisor, timeout_s=10)
    rank0 = client.call(P.Register(role=P.Role.TRAINER, host="h", pid=2, rank=0, shard_address="127.0.0.1:10"))
    rank1 = client.call(P.Register(role=P.Role.TRAINER, host="h", pid=3, rank=1, shard_address="127.0.0.1:11"))
    rollout = client.call(P.Register(role=P.Role.ROLLOUT, host="h", pid=4, shard_address="127.0.0.1:12"))
    client.call(P.Heartbeat(worker_id=rank1.worker_id, stats={"published_version": 3}))
    hb = client.call(P.Heartbeat(worker_id=rollout.worker_id))
    assert hb.policy_version == 0 and hb.weights_address != "127.0.0.1:11"
    client.call(P.Heartbeat(worker_id=rank0.worker_id, stats={"published_version": 2}))
    hb = client.call(P.Heartbeat(worker_id=rollout.worker_id))
    assert (hb.policy_version, hb.weights_address) == (2, "127.0.0.1:10")
    client.call(P.Heartbeat(worker_id=rank1.worker_id, stats={"published_version": 3}))
    assert client.call(P.Heartbeat(worker_id=rollout.worker_id)).weights_address == "127.0.0.1:10"


def test_a_heartbeat_built_before_a_publish_does_not_roll_the_version_back(supervisor: str) -> None:
    """The trainer's heartbeat thread reads its published version, then sends on its own socket: a heartbeat built
    just before a publish can arrive after it, one version behind. Taking it pointed the rollout workers at the
    older weights, which an in-place swap then applied mid-episode (a staleness-0 run trained on the older
    version's tokens). Only a PublishVersion may move the version back (a trainer resumed from an older checkpoint)."""
    client = P.ControlClient(supervisor, timeout_s=10)
    rank0 = client.call(P.Register(role=P.Role.TRAINER, host="h", pid=2, rank=0, shard_address="127.0.0.1:10"))
    rollout = client.call(P.Register(role=P.Role.ROLLOUT, host="h", pid=4, shard_address="127.0.0.1:12"))
    client.call(P.PublishVersion(worker_id=rank0.worker_id, version=2, weights_address="127.0.0.1:10"))
    client.call(P.Heartbeat(worker_id=rank0.worker_id, stats={"published_version": 1}))  # overtaken by the publish
    assert client.call(P.Heartbeat(worker_id=rollout.worker_id)).policy_version == 2
    client.call(P.PublishVersion(worker_id=rank0.worker_id, version=1, weights_address="127.0.0.1:10"))  # a resume
    assert client.call(P.Heartbeat(worker_id=rollout.worker_id)).policy_version == 1
