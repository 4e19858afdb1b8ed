"""The cluster secret: where it comes from and how control-plane messages prove it.

Every control-plane message is sent as MAC || nonce || time || payload: MAC = HMAC-SHA256(secret,
nonce || time || payload), a random 16-byte nonce and the sender's wall-clock time (IEEE double,
big-endian). A receiver with a `ReplayGuard` (the supervisor, the environment servers, every client
for its replies) refuses a message whose time lies outside its window (REPLAY_WINDOW_S either side:
stale, or a clock far off) or whose nonce it has seen within the window (a replay), and counts it;
anything whose MAC does not verify is dropped and logged, and the peer is told only "authentication
failed". The data plane (shard nodes) uses the same secret in its own challenge-response
handshake (`earl_stream.store.wire`). Without a secret, both planes are open: servers then bind
127.0.0.1 unless told otherwise.

It also owns how a command finds the secret of the run it is pointed at (`find_run_secret`): `up`
keeps the secret in RUN_DIR/secret beside the supervisor's ready file RUN_DIR/supervisor.json, so a
command run in the directory `up` ran in, naming the address that ready file records, needs no flag.
And it words the refusal (`secret_refusal_hint`): what to pass and where the run's secret is.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from earl_stream.errors import ConfigError

SECRET_ENV = "EARL_STREAM_SECRET_FILE"
MAC_BYTES = 32
READY_FILE = "supervisor.json"  # in RUN_DIR: {address, metrics_address}, written by the supervisor `up` starts
RUN_SECRET = "secret"  # in RUN_DIR: the run's secret (or a link to the file `up` was given)
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", ""})
K = TypeVar("K")


def load_secret(path: str | None = None) -> bytes | None:
    """The secret from `path`, else from the file named by $EARL_STREAM_SECRET_FILE, else None."""
    path = path or os.environ.get(SECRET_ENV)
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"cluster secret file {p} does not exist")
    data = p.read_bytes().strip()
    if len(data) < 16:
        raise ConfigError(f"cluster secret in {p} is too short ({len(data)} bytes; use at least 16)")
    return data


def create_secret_file(path: Path) -> Path:
    """Write a new random secret readable only by this user."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh file, never an old one: O_TRUNC would write through a link (to a secret `up` was given)
    # and keep an old file's looser permissions.
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


NONCE_BYTES = 16
_STAMP = struct.Struct("!16sd")  # nonce, sender's wall-clock time (seconds since the epoch)
REPLAY_WINDOW_S = 60.0  # how far a message's time may lie from the receiver's clock, either side
SIGNED_OVERHEAD = MAC_BYTES + _STAMP.size


def sign(secret: bytes | None, payload: bytes) -> bytes:
    """MAC || nonce || time || payload (the payload alone when the plane is open: no secret)."""
    if secret is None:
        return payload
    stamped = _STAMP.pack(os.urandom(NONCE_BYTES), time.time()) + payload
    return hmac.new(secret, stamped, hashlib.sha256).digest() + stamped


class Refusal(enum.Enum):
    """Why a signed message was refused (the value names it in logs and the refusal metric)."""

    UNSIGNED = "unsigned"  # the MAC does not verify: another secret, no secret, or altered bytes
    STALE = "stale"  # its time lies outside the window: an old capture, or the sender's clock is off
    REPLAYED = "replayed"  # its nonce was seen within the window


class ReplayGuard:
    """The nonces a receiver has accepted within the window, forgotten once they leave it.

    Bounded: beyond `max_nonces` the oldest are forgotten and every message up to their time counts
    as stale from then on, so a replay is never accepted for lack of memory."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, max_nonces: int = 1_000_000) -> None:
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._seen: set[bytes] = set()
        self._order: collections.deque[tuple[float, bytes]] = collections.deque()
        self._floor = 0.0  # messages stamped at or before this are stale (their nonces may be forgotten)
        self.refused: collections.Counter[Refusal] = collections.Counter()

    def admit(self, nonce: bytes, stamp: float, now: float | None = None) -> Refusal | None:
        now = time.time() if now is None else now
        # NaN never compares inside the window: refused as stale, as is anything outside it
        if not (now - self.window_s < stamp < now + self.window_s) or stamp <= self._floor:
            return self._refuse(Refusal.STALE)
        if nonce in self._seen:
            return self._refuse(Refusal.REPLAYED)
        while self._order and (self._order[0][0] <= now - self.window_s or len(self._order) >= self.max_nonces):
            old_stamp, old = self._order.popleft()
            self._seen.discard(old)
            if old_stamp > now - self.window_s:  # forgotten for room, not for age
                self._floor = max(self._floor, old_stamp)
        self._seen.add(nonce)
        self._order.append((stamp, nonce))
        return None

    def _refuse(self, why: Refusal) -> Refusal:
        self.refused[why] += 1
        return why


def check(secret: bytes | None, frame: bytes, guard: ReplayGuard | None = None) -> bytes | Refusal:
    """The payload of a signed frame, or why it is refused (`guard`: refuse stale and replayed ones).
    With no secret the plane is open: the frame is the payload."""
    if secret is None:
        return frame
    if len(frame) < SIGNED_OVERHEAD:
        return guard._refuse(Refusal.UNSIGNED) if guard is not None else Refusal.UNSIGNED
    mac, stamped = frame[:MAC_BYTES], frame[MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(secret, stamped, hashlib.sha256).digest()):
        return guard._refuse(Refusal.UNSIGNED) if guard is not None else Refusal.UNSIGNED
    nonce, stamp = _STAMP.unpack_from(stamped)
    if guard is not None:
        why = guard.admit(nonce, stamp)
        if why is not None:
            return why
    return stamped[_STAMP.size:]


def check_keys(keys: Mapping[K, bytes], frame: bytes, guard: ReplayGuard) -> tuple[K, bytes] | Refusal:
    """Which of `keys` signed the frame, and its payload; or why it is refused. The supervisor's check:
    each role's key is tried (`keys.keyring`), and the guard admits the nonce once, after a MAC verified."""
    if len(frame) < SIGNED_OVERHEAD:
        return guard._refuse(Refusal.UNSIGNED)
    mac, stamped = frame[:MAC_BYTES], frame[MAC_BYTES:]
    for name, key in keys.items():
        if hmac.compare_digest(mac, hmac.new(key, stamped, hashlib.sha256).digest()):
            nonce, stamp = _STAMP.unpack_from(stamped)
            why = guard.admit(nonce, stamp)
            return why if why is not None else (name, stamped[_STAMP.size:])
    return guard._refuse(Refusal.UNSIGNED)


def verify(secret: bytes | None, frame: bytes, guard: ReplayGuard | None = None) -> bytes | None:
    """The payload if the frame's MAC verifies (and `guard` admits it), or no secret is set; else None."""
    payload = check(secret, frame, guard)
    return None if isinstance(payload, Refusal) else payload


def refusal_text(why: Refusal, window_s: float = REPLAY_WINDOW_S) -> str:
    """What the supervisor answers a refused message (the peer learns the kind of refusal, no more)."""
    if why is Refusal.STALE:
        return (f"authentication failed: the message's time is more than {window_s:.0f}s from this host's clock "
                "(a stale or replayed message, or a clock that is off: synchronise the hosts' clocks)")
    if why is Refusal.REPLAYED:
        return "authentication failed: a replayed message (its nonce was already used)"
    return "authentication failed"


@dataclass(frozen=True)
class RunSecret:
    """A run directory found for a supervisor address, and its secret file."""

    run_dir: Path
    secret_file: Path


def find_run_secret(address: str, where: Path | None = None) -> RunSecret | None:
    """The run in `where` (default: the working directory, or a `runs/*` directory below it) whose
    ready file records `address`, if that run has a secret file; the newest such run if several do
    (a stale ready file may name a port that a later run reuses)."""
    where = Path.cwd() if where is None else where
    found: dict[Path, float] = {}
    for ready in [where / READY_FILE, *(where / "runs").glob(f"*/{READY_FILE}")]:
        try:
            recorded = json.loads(ready.read_text())["address"]
            mtime = ready.stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(recorded, str) and same_supervisor(recorded, address) and (ready.parent / RUN_SECRET).is_file():
            found[ready.parent.resolve()] = mtime
    if not found:
        return None
    run_dir = max(found, key=lambda d: found[d])
    return RunSecret(run_dir, run_dir / RUN_SECRET)


def use_secret(given: str | None, address: str | None) -> RunSecret | None:
    """Set $EARL_STREAM_SECRET_FILE (children inherit it) to the secret a command uses: `given`
    (--secret-file), else the variable as already set, else the secret of the run that
    `find_run_secret` finds for `address`; returns that run when the secret came from it."""
    if given:
        os.environ[SECRET_ENV] = os.path.abspath(given)
        return None
    if os.environ.get(SECRET_ENV) or not address:
        return None
    run = find_run_secret(address)
    if run is not None:
        os.environ[SECRET_ENV] = str(run.secret_file)
    return run


def _endpoint(address: str) -> tuple[str, int] | None:
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    return (host.strip("[]"), int(port)) if sep and port.isdigit() else None


def _ips(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def _is_this_host(ip: str) -> bool:
    try:
        if ipaddress.ip_address(ip).is_loopback:
            return True
    except ValueError:
        return False
    return ip in _ips(socket.gethostname())


def same_supervisor(recorded: str, wanted: str) -> bool:
    """Whether `wanted` (what the user typed: tcp://HOST:PORT or HOST:PORT) reaches the supervisor that
    listens on `recorded` (from a ready file on this host): same port, and the same host by name or
    address, or any address of this host when it listens on all of them."""
    a, b = _endpoint(recorded), _endpoint(wanted)
    if a is None or b is None or a[1] != b[1]:
        return False
    if a[0] == b[0]:
        return True
    wanted_ips = _ips(b[0])
    if a[0] in _WILDCARD_HOSTS:
        return any(_is_this_host(ip) for ip in wanted_ips)
    return bool(wanted_ips & _ips(a[0]))


def is_secret_refusal(message: str) -> bool:
    """Whether an error message is a peer refusing us for the cluster secret. The supervisor answers an
    unverifiable message with "authentication failed", shard nodes likewise, and the control client
    reports a reply it cannot verify as "not signed with our cluster secret" (`protocol.ControlClient`)."""
    return "authentication failed" in message or "not signed with our cluster secret" in message


def secret_refusal_hint(address: str | None) -> str:
    """What to do when the run at `address` refused our secret (or its absence): which secret was used,
    where the run's own secret is when this directory holds the run, and what to pass."""
    used = os.environ.get(SECRET_ENV)
    run = find_run_secret(address) if address else None
    if used is None:
        said = "no cluster secret was given"
    elif run is not None and Path(used).resolve() == run.secret_file.resolve():
        said = (f"the secret in {run.secret_file} (the run in {run.run_dir}, whose ready file names this address) "
                "was refused: the supervisor was started with another one")
    else:
        said = f"the secret in {used} is not this run's"
    if run is not None and (used is None or Path(used).resolve() != run.secret_file.resolve()):
        where = f"this run keeps its secret in {run.secret_file}"
    else:
        where = (f"`earl-stream up` keeps a run's secret in RUN_DIR/{RUN_SECRET} (by default runs/latest/{RUN_SECRET} "
                 "in the directory it was started in; in that directory, commands find it without flags)")
    return f"; {said}; {where}: pass --secret-file PATH or set {SECRET_ENV}=PATH"
