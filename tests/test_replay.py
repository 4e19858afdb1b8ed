"""Signed control messages carry a nonce and a time: a captured message sent again, or one stamped
outside the window, is refused (and counted) by the supervisor, which registers nothing from it; the
guard's memory is bounded without ever admitting a replay."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
import time
import urllib.request
from pathlib import Path

import pytest
import zmq
from cluster import Cluster

from earl_stream import protocol as P
from earl_stream.security.secret import MAC_BYTES, Refusal, ReplayGuard, check, load_secret, sign, verify


def _stamped(secret: bytes, payload: bytes, when: float, nonce: bytes = b"n" * 16) -> bytes:
    """A frame signed as `sign` does, at a chosen time and nonce (what an attacker cannot forge)."""
    body = struct.pack("!16sd", nonce, when) + payload
    return hmac.new(secret, body, hashlib.sha256).digest() + body


def test_sign_and_check_refuse_replays_stale_and_altered_frames() -> None:
    secret, guard = b"s" * 32, ReplayGuard(window_s=30)
    frame = sign(secret, b"payload")
    assert check(secret, frame, guard) == b"payload"
    assert check(secret, frame, guard) is Refusal.REPLAYED  # the same bytes again
    assert verify(secret, frame) == b"payload"  # without a guard only the MAC is checked
    assert check(secret, _stamped(secret, b"p", time.time() - 31), guard) is Refusal.STALE
    assert check(secret, _stamped(secret, b"p", time.time() + 31), guard) is Refusal.STALE  # a clock far ahead
    assert check(secret, _stamped(secret, b"p", float("nan")), guard) is Refusal.STALE
    altered = bytearray(sign(secret, b"payload"))
    altered[-1] ^= 1
    assert check(secret, bytes(altered), guard) is Refusal.UNSIGNED
    assert check(secret, frame[:MAC_BYTES], guard) is Refusal.UNSIGNED  # truncated
    assert check(b"t" * 32, sign(secret, b"x"), guard) is Refusal.UNSIGNED  # another secret
    assert guard.refused == {Refusal.REPLAYED: 1, Refusal.STALE: 3, Refusal.UNSIGNED: 3}
    assert check(None, b"open plane", guard) == b"open plane"


def test_the_guard_forgets_old_nonces_but_never_admits_a_replay() -> None:
    guard = ReplayGuard(window_s=10, max_nonces=3)
    t0 = 1000.0
    for i in range(3):
        assert guard.admit(bytes([i]) * 16, t0 + i, now=t0 + i) is None
    # a fourth nonce within the window forces the oldest out: from then on its time counts as stale
    assert guard.admit(b"\x03" * 16, t0 + 3, now=t0 + 3) is None
    assert guard.admit(b"\x00" * 16, t0, now=t0 + 3) is Refusal.STALE  # forgotten, yet refused
    assert guard.admit(b"\x02" * 16, t0 + 2, now=t0 + 3) is Refusal.REPLAYED  # still remembered
    # nonces that age out of the window are forgotten for free: the window itself refuses them
    assert guard.admit(b"\x09" * 16, t0 + 20, now=t0 + 20) is None
    assert guard.admit(b"\x01" * 16, t0 + 1, now=t0 + 20) is Refusal.STALE


@pytest.mark.slow
def test_the_supervisor_refuses_a_replayed_register_and_counts_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_supervisor()
        secret = load_secret(str(cluster.secret_file))
        assert secret is not None
        captured = sign(secret, P.encode(P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:1")))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cluster.address)
        replies = []
        for frame in (captured, captured, _stamped(secret, P.encode(P.StatusRequest()), time.time() - 3600)):
            sock.send_multipart([b"", frame])
            assert sock.poll(10_000), "the supervisor answers every frame"
            replies.append(sock.recv_multipart()[-1])
        sock.close(0)
        assert isinstance(P.decode(verify(secret, replies[0]) or b""), P.Registered)
        second, third = P.decode(replies[1]), P.decode(replies[2])
        assert isinstance(second, P.ErrorReply) and "replayed message" in second.message
        assert isinstance(third, P.ErrorReply) and "synchronise the hosts' clocks" in third.message
        assert len(cluster.status()["workers"]) == 1  # the replay registered nothing
        log = (tmp_path / "supervisor.log").read_text()
        assert "refused a control message (replayed)" in log and "refused a control message (stale)" in log
        metrics = json.loads((tmp_path / "ready.json").read_text())["metrics_address"]
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
        counts = dict(re.findall(r'earl_security_refused_total\{plane="control",reason="(\w+)"\} (\S+)', text))
        assert float(counts["replayed"]) == 1 and float(counts["stale"]) == 1
    finally:
        cluster.stop()
