"""Encryption of both planes: `security.encrypt`, on by default when the pools span hosts (any launcher but
local, and the job `slurm submit` renders: `config.load.resolve_auto`), off for a local run.

- Control plane (the supervisor and environment servers, ZMQ): CURVE. The server's key pair is derived
  from the cluster secret (HMAC-SHA256 under a fixed context), so every process holding the secret
  knows the server's public key and nothing has to be distributed; each client uses a fresh key pair
  per socket. CURVE encrypts and authenticates the connection; the signed, replay-proof messages of
  `security.py` still prove the secret inside it.
- Data plane (shard nodes): the frames after the handshake are encrypted with ChaCha20 under a key of
  their own (derived like their Poly1305 MAC keys, `store/frame_mac.py`), and the tag covers the
  ciphertext. The node announces it in its CHALLENGE; a client that wants encryption refuses a node
  that does not encrypt. Not encrypted: bytes a same-host peer reads from shared memory (they never
  leave the host), and UCX transfers, so under encryption a node does not offer UCX and a client asking
  for `store.transport=ucx` is refused.

Whether a process encrypts: the config (`security.encrypt`) for the processes `up` starts and for the
supervisor; clients that connect before they have the run's config (workers, `status`, `scale`) read
$EARL_STREAM_ENCRYPT, which `up` sets for its children and `worker --encrypt` sets. A client that does
not encrypt gets no answer from an encrypting supervisor (CURVE drops its handshake): its timeout says
to check `--encrypt`.
"""

from __future__ import annotations

import os

import zmq
import zmq.utils.z85

from earl_stream.errors import ConfigError
from earl_stream.security.keys import curve_server_keys, parse_role_token

ENCRYPT_ENV = "EARL_STREAM_ENCRYPT"
HINT = ("if the run uses security.encrypt=true, this process must encrypt too: pass --encrypt (or set "
        f"{ENCRYPT_ENV}=1)")


def encrypt_enabled(given: bool | None = None) -> bool:
    """`given` if set, else $EARL_STREAM_ENCRYPT ("1"/"true": on)."""
    if given is not None:
        return given
    return os.environ.get(ENCRYPT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def export_encrypt(on: bool) -> None:
    """Make this process and the processes it starts encrypt (or not) by default."""
    os.environ[ENCRYPT_ENV] = "1" if on else "0"


def _check_curve(secret: bytes | None) -> bytes:
    if secret is None:
        raise ConfigError("security.encrypt needs the cluster secret (its keys are derived from it); "
                          "pass --secret-file or run under `earl-stream up`, which makes one")
    if not zmq.has("curve"):
        raise ConfigError(f"security.encrypt needs libzmq with CURVE; this pyzmq's libzmq {zmq.zmq_version()} has none")
    return secret


def curve_server(sock: zmq.Socket, secret: bytes | None) -> None:
    """Make `sock` (before bind) a CURVE server of the run's key pair."""
    if parse_role_token(_check_curve(secret)) is not None:
        raise ConfigError("a control-plane server needs the cluster secret, not a role key (`keys derive` prints "
                          "keys for clients)")
    public, private = curve_server_keys(_check_curve(secret))
    sock.curve_publickey, sock.curve_secretkey = public, private
    sock.curve_server = True


def curve_client(sock: zmq.Socket, secret: bytes | None) -> None:
    """Make `sock` (before connect) a CURVE client of the run's servers, with a fresh key pair. `secret` may
    be a role key (`earl_stream.security.keys`), which carries the servers' public key."""
    role_key = parse_role_token(_check_curve(secret))
    server_public = role_key.curve_public if role_key is not None else curve_server_keys(_check_curve(secret))[0]
    public, private = zmq.curve_keypair()
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, private, server_public
