"""The supervisor's process: its socket, the write-ahead state around `Supervisor.handle`, its metrics.

Each turn of the loop takes every message waiting on the socket (up to BATCH), verifies each (the
cluster secret, its nonce and time: security/secret.py), hands it to the state machine, logs the accepted
state-changing ones (supervisor/wal.py), makes the log durable with one fsync for the whole batch and
only then sends the batch's replies. Leases are checked and metrics exported between turns; a worker
declared dead for a missed lease is logged too, so that a restarted supervisor replays the same story.

Keys: a message verifies under one role's current key (the generations of `revocation.py`), that role must
be allowed to send it (`access.py`), and its worker id must not be revoked. `RevokeKey` is answered here, not
by the state machine: it changes which keys verify from the next message on, and evicts a revoked worker
like a dead one (logged as such).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from pathlib import Path

import zmq

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.config import RunConfig
from earl_stream.errors import ConfigError, ProtocolError
from earl_stream.files import write_durably
from earl_stream.model.hub import pin_model
from earl_stream.security import encryption
from earl_stream.security.keys import KeyRole, role_of
from earl_stream.security.secret import Refusal, ReplayGuard, check_keys, refusal_text, sign
from earl_stream.supervisor import access
from earl_stream.supervisor.metrics_log import MetricsLog
from earl_stream.supervisor.revocation import Revocations
from earl_stream.supervisor.server import Supervisor
from earl_stream.supervisor.wal import StateLog, WalStats

log = logging.getLogger(__name__)
BATCH = 256  # messages handled between two fsyncs at most
TICK_S = 0.25  # leases, metrics and snapshots between message batches
MAX_MESSAGE_BYTES = 16 << 20  # the largest control message taken (metadata of ~50,000 samples)


def serve(cfg: RunConfig, bind: str, *, ready_file: str | None = None, secret: bytes | None = None,
          state_dir: str | None = None, forget_workers: bool = False) -> None:
    """Run the supervisor until SIGTERM/SIGINT. `bind` is host:port (port 0 = pick a free one)."""
    cfg = pin_model(cfg)  # a Hub model of a supervisor started by hand: pinned before any worker registers
    _check_secret(secret)
    revoked = Revocations.load(Path(state_dir or cfg.run_dir))
    keys = revoked.keyring(secret) if secret is not None else None
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a bigger frame drops its peer's connection
    if cfg.security.encrypt:
        encryption.curve_server(sock, secret)
    host, _, port = bind.rpartition(":")
    try:
        if port in ("", "0"):
            bound = sock.bind_to_random_port(f"tcp://{host or '127.0.0.1'}")
        else:
            sock.bind(f"tcp://{host}:{port}")
            bound = int(port)
    except zmq.ZMQError as exc:
        raise ProtocolError(f"cannot bind the supervisor to {bind}: {exc.strerror}") from None
    address = f"tcp://{host or '127.0.0.1'}:{bound}"
    sup = Supervisor(cfg, address=address)
    sup.revoked_workers = revoked.workers  # for `status`
    state = StateLog(Path(state_dir or cfg.run_dir))
    journal_path = state.dir / "trained.jsonl"
    restored = state.state_path.exists() or state.log_path.exists()
    state.recover(sup, time.monotonic())
    if restored:
        log.info("restored state from %s: policy version %d, %d prompts issued, %d samples waiting", state.dir,
                 sup.policy_version, sup.ledger.next_ordinal, sup.ledger.samples_waiting())
    if forget_workers:
        sup.forget_workers()
    # after the recovery: steps replayed from the log are already in the file (or were lost with their times)
    sup.metrics_log = MetricsLog(cfg.run_dir, sup.run_id)
    state.snapshot(sup)  # a fresh log from here on
    M.register_supervisor_metrics()
    metrics_address = M.start_metrics_server(host or "127.0.0.1")
    sup.metrics_address = metrics_address
    log.info("supervisor listening on %s (metrics on http://%s/metrics)", address, metrics_address)
    if ready_file:
        # whole or absent: a reader polling for the file must never read it half-written
        write_durably(Path(ready_file), json.dumps({"address": address, "metrics_address": metrics_address}).encode())
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    guard = ReplayGuard()  # refuses replayed and stale signed messages (security/secret.py)
    last_tick = 0.0
    exported = WalStats()
    while not stopping:
        if sock.poll(100):
            replies: list[list[bytes]] = []
            while len(replies) < BATCH and sock.poll(0):
                frames = sock.recv_multipart()
                replies.append([frames[0], b"", _answer(sup, state, guard, keys, revoked, frames)])
            _write_journal(sup, journal_path)
            state.commit()  # write-ahead: durable before any peer of the batch hears back
            for reply in replies:
                sock.send_multipart(reply)
            M.SUP_MESSAGES.inc(len(replies))
        now = time.monotonic()
        if now - last_tick > TICK_S:
            sup.check_leases(now)
            for worker_id, why in sup.expired:
                state.append_lease_expired(worker_id, why)
            sup.expired.clear()
            _write_journal(sup, journal_path)
            state.commit()
            state.maybe_snapshot(sup)
            exported = _export_state_metrics(state, exported)
            sup.export_metrics(now)
            last_tick = now
    state.close(sup)
    sock.close(0)
    log.info("supervisor stopped")


def _check_secret(secret: bytes | None) -> None:
    held = role_of(secret)
    if held is not None and held is not KeyRole.CLUSTER:
        raise ConfigError(f"the supervisor needs the cluster secret; it was given the {held.value} key "
                          "(a derived key is for clients: status, scale, env, episodes)")


def _answer(sup: Supervisor, state: StateLog, guard: ReplayGuard, keys: dict[KeyRole, bytes] | None,
            revoked: Revocations, frames: list[bytes]) -> bytes:
    """The reply (signed with the key the message was signed with) to one message, which is logged if it
    changed the state. `keys`: every role's current key (keys.keyring); None: an open run."""
    role, payload = KeyRole.CLUSTER, frames[-1]
    if keys is not None:
        checked = check_keys(keys, frames[-1], guard)
        if isinstance(checked, Refusal):
            M.SECURITY_REFUSED.labels("control", checked.value).inc()
            log.warning("refused a control message (%s) from peer %s", checked.value, frames[0].hex()[:16])
            return P.encode(P.ErrorReply(message=refusal_text(checked, guard.window_s)))
        role, payload = checked
    key = keys[role] if keys is not None else None
    try:
        msg = P.decode(payload)
        refused = access.refusal(role, msg, lambda wid: _is_trainer(sup, wid))
        if refused is not None:  # nothing of it is handled or logged
            M.SECURITY_REFUSED.labels("control", "role").inc()
            log.warning("refused %s from peer %s: signed with the %s key", type(msg).__name__, frames[0].hex()[:16],
                        role.value)
            return sign(key, P.encode(P.ErrorReply(message=refused)))
        if isinstance(msg, P.RevokeKey):
            return sign(key, P.encode(_revoke(sup, state, revoked, keys, msg)))
        if getattr(msg, "worker_id", "") in revoked.workers:
            M.SECURITY_REFUSED.labels("control", "revoked").inc()
            log.warning("refused %s from revoked worker %s", type(msg).__name__, msg.worker_id)
            return sign(key, P.encode(P.ErrorReply(message=f"worker {msg.worker_id} is revoked (keys revoke): its "
                                                            "messages are refused")))
        reply = sup.handle(msg, time.monotonic())
        state.append_message(msg, payload)
    except ProtocolError as exc:
        log.warning("bad control message from peer %s: %s", frames[0].hex()[:16], exc)
        reply = P.ErrorReply(message=str(exc))
    return sign(key, P.encode(reply))


def _is_trainer(sup: Supervisor, worker_id: str) -> bool:
    w = sup.workers.get(worker_id)
    return w is not None and w.alive and w.role == P.Role.TRAINER


def _revoke(sup: Supervisor, state: StateLog, revoked: Revocations, keys: dict[KeyRole, bytes] | None,
            msg: P.RevokeKey) -> P.Msg:
    """Revoke a role's key (the keyring changes now) or a worker id (evicted like a dead worker, and logged so)."""
    if keys is None:
        return P.ErrorReply(message="an open run (no cluster secret) has no keys to revoke")
    try:
        what = revoked.revoke(msg.target, keys[KeyRole.CLUSTER], set(sup.workers))
    except ConfigError as exc:
        return P.ErrorReply(message=str(exc))
    keys.update(revoked.keyring(keys[KeyRole.CLUSTER]))
    worker = sup.workers.get(msg.target)
    if msg.target in revoked.workers and worker is not None and worker.alive:
        why = "its key was revoked (keys revoke)"
        sup.declare_dead(worker, why)
        state.append_lease_expired(worker.worker_id, why)
    return P.RevokeReply(message=what)


def _write_journal(sup: Supervisor, path: Path) -> None:
    """Append each released step's prompt ordinals to `trained.jsonl` in the state directory.

    One JSON line per step: {"step", "trained": [ordinals], "lost": [ordinals]}. A step released,
    journaled and then replayed by a restarted supervisor is released again, so a step may appear
    twice, with the same ordinals.
    """
    if not sup.ledger.journal:
        return
    with path.open("a") as f:
        for entry in sup.ledger.journal:
            f.write(json.dumps(entry) + "\n")
    sup.ledger.journal.clear()


def _export_state_metrics(state: StateLog, before: WalStats) -> WalStats:
    """Add what the write-ahead state wrote since `before` to the supervisor's counters."""
    now = dataclasses.replace(state.stats)
    M.SUP_STATE_BYTES.labels("log").inc(now.bytes_logged - before.bytes_logged)
    M.SUP_STATE_BYTES.labels("snapshot").inc(now.bytes_snapshots - before.bytes_snapshots)
    M.SUP_STATE_FSYNCS.inc(now.fsyncs - before.fsyncs)
    return now
