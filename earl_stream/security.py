"""The cluster secret: where it comes from and how control-plane messages prove it.

Every control-plane message is sent as HMAC-SHA256(secret, payload) || payload; the supervisor
drops (and logs) anything whose MAC does not verify, and tells the peer only "authentication
failed". The data plane (shard nodes) uses the same secret in its own challenge-response
handshake (`earl_stream.store.wire`). Without a secret, both planes are open: servers then bind
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from earl_stream.errors import ConfigError

SECRET_ENV = "EARL_STREAM_SECRET_FILE"
MAC_BYTES = 32


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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def sign(secret: bytes | None, payload: bytes) -> bytes:
    if secret is None:
        return payload
    return hmac.new(secret, payload, hashlib.sha256).digest() + payload


def verify(secret: bytes | None, frame: bytes) -> bytes | None:
    """The payload if the frame's MAC verifies (or no secret is set), else None."""
    if secret is None:
        return frame
    if len(frame) < MAC_BYTES:
        return None
    mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
    good = hmac.new(secret, payload, hashlib.sha256).digest()
    return payload if hmac.compare_digest(mac, good) else None
