"""Scoped credentials, all derived from the cluster secret: which key a holder gets, and what it proves.

One file (the cluster secret) sets up a cluster, and only the processes that manage it hold it: the
supervisor, `up` and an operator's shell. Every other key is derived from it, so nothing else has to be
distributed, and a holder of a derived key cannot derive the secret or a key above its own.

- **cluster secret** (`KeyRole.CLUSTER`): the supervisor, `up`, `keys derive`; allowed everything.
- **worker key** (`KeyRole.WORKER`): what rollout workers and trainer ranks hold, whoever starts them (`up`'s
  launchers, Ray, Slurm, Kubernetes, by hand). It registers them and sends what they send (heartbeats,
  metadata, claims, releases, weight versions, the trainer's end of the run); never scale, env attach|detach,
  an operator's stop or `keys revoke`. It carries the run's **worker-plane key** (below), from which a worker
  derives everything else it needs.
- **operator key** (`KeyRole.OPERATOR`): `scale`, `env attach|detach`, stopping the run, `keys revoke`, and what
  the read-only key may do.
- **read-only key** (`KeyRole.READONLY`): `status`, `env list`, `episodes tail|export` (metadata; the
  transcripts live on the data plane) and metrics scraping (its token is the metrics bearer token).
- **agent key** (`KeyRole.AGENT`): one episode's requests to one rollout worker's OpenAI endpoint, while that
  episode runs there and until its expiry; no control-plane message at all.

The worker-plane key W = HMAC(secret, "worker plane") roots every key of what workers serve to each other
(`plane_key`): the data plane's (shard nodes, weight pulls, relays), the environment servers', the agent keys'
root, the run CA's seed (TLS endpoints) and the read-only token (the bearer token a worker's metrics ask for).
A holder of the secret derives W, a holder of the worker key reads it from the key: both derive the same keys.
So a worker key implies the read-only key (a worker serves the metrics that key scrapes) but not the operator's.

A role key is a printable token, `earl-ROLE-<64 hex key>:<64 hex>` (a worker key: `...:<64 hex W>`): the
second part is the public CURVE key of the run's control-plane servers (`encryption`), so that a holder of a
role key can connect to an encrypting supervisor. Control messages are signed with the whole token as the
HMAC key (`security.sign`); the supervisor derives every role's token and finds the one a message verifies
under (`security.check_keys`). An agent key is `earl-agent-<expiry>-<64 hex MAC>-<episode>`, a MAC of the
episode and its expiry (unix seconds) under a key derived from W: an endpoint verifies it without a list.

**Revocation.** The worker and operator keys have a generation (0 at first; part of their derivation).
`keys revoke worker|operator` (operator key or secret) bumps it: the supervisor verifies messages against the
new token only from the next message on, and rewrites RUN_DIR/keys/worker (the file `up`'s launchers hand
workers), which a worker re-reads when the supervisor refuses its key (`protocol.ControlClient`): workers `up`
started keep running, any other holder of the old key is locked out of the control plane. W does not change
with a generation (the shard nodes of the running workers keep their keys), so a revoked worker key still
opens the data plane and environment servers until the run is restarted with a new secret: revocation guards
the control plane. `keys revoke WORKER_ID` refuses that worker id from then on (its registration, heartbeats
and every other message) and evicts it like a dead worker, so its prompts are re-issued; since workers share
one worker key, a process still holding it can register again under a new id: revoke the role to shut it out.
The generations and revoked ids live in RUN_DIR/keys/revoked.json (`supervisor/revocation.py`), so a
restarted supervisor and `keys derive` use the current ones.

Which message each role may send is the supervisor's (`supervisor/access.py`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.utils.z85

from earl_stream.errors import ConfigError, EarlError

TOKEN_PREFIX = "earl-"
_ROLE_CONTEXT = b"earl_stream role key v1:"
_AGENT_CONTEXT = b"earl_stream agent key v1"
AGENT_PREFIX = "earl-agent-"
_CURVE_CONTEXT = b"earl_stream control-plane CURVE server key v1"
_PLANE_CONTEXT = b"earl_stream worker plane v1"
WORKER_KEY_FILE = "keys/worker"  # in RUN_DIR: the worker key `up`'s launchers hand workers (rewritten on revocation)


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of every control-plane server of the run holding `secret`."""
    seed = hmac.new(secret, _CURVE_CONTEXT, hashlib.sha256).digest()
    private = zmq.utils.z85.encode(seed)
    return zmq.curve_public(private), private


class KeyRole(str, enum.Enum):
    """Who holds a key (the value names it in `keys derive ROLE`, refusals and logs)."""

    CLUSTER = "cluster"  # the cluster secret itself
    WORKER = "worker"
    OPERATOR = "operator"
    READONLY = "readonly"
    AGENT = "agent"


ROLE_KEYS = (KeyRole.WORKER, KeyRole.OPERATOR, KeyRole.READONLY)  # the control-plane keys derived per role
REVOCABLE = (KeyRole.WORKER, KeyRole.OPERATOR)  # the roles whose key has a generation (`keys revoke ROLE`)


class Plane(bytes, enum.Enum):
    """What a key derived from the worker-plane key guards (its value is the derivation's context)."""

    DATA = b"data plane"  # shard nodes: their handshake and frame MACs (store/wire.py, store/frame_mac.py)
    ENV = b"environment servers"  # env/server.py's signed messages
    AGENT = b"agent keys"  # the root of every agent key's MAC
    TLS_CA = b"run CA"  # the seed of the run CA's key (security/tls.py)
    READONLY = b"read-only key"  # the read-only token's key


def role_token(secret: bytes, role: KeyRole, generation: int = 0) -> bytes:
    """The token of `role` at `generation` for the run holding `secret` (see the module docstring)."""
    if role not in ROLE_KEYS:
        raise ConfigError(f"no role key for {role.value!r}: roles with a key are {[r.value for r in ROLE_KEYS]}"
                          + ("; an agent key is per episode (keys derive agent --episode ID)" if role is KeyRole.AGENT
                             else ""))
    if role is KeyRole.READONLY:
        return readonly_token(secret)
    context = _ROLE_CONTEXT + role.value.encode() + (f"#{generation}".encode() if generation else b"")
    key = hmac.new(secret, context, hashlib.sha256).hexdigest()
    plane = f":{_worker_plane(secret).hex()}" if role is KeyRole.WORKER else ""
    return f"{TOKEN_PREFIX}{role.value}-{key}:{_curve_public_hex(secret)}{plane}".encode()


def readonly_token(credential: bytes) -> bytes:
    """The read-only token, from the cluster secret or a worker key (its key derives from the worker plane)."""
    key = plane_key(credential, Plane.READONLY)
    parsed = parse_role_token(credential)
    public = parsed.curve_public_hex if parsed is not None else _curve_public_hex(credential)
    return f"{TOKEN_PREFIX}{KeyRole.READONLY.value}-{key.hex()}:{public}".encode()


def _worker_plane(secret: bytes) -> bytes:
    return hmac.new(secret, _PLANE_CONTEXT, hashlib.sha256).digest()


def plane_key(credential: bytes, plane: Plane) -> bytes:
    """The key guarding `plane`, from the cluster secret or a worker key (the same from both). Any other
    credential is a ConfigError: a read-only, operator or agent key opens no plane a worker serves."""
    held = role_of(credential)
    if held is KeyRole.CLUSTER:
        root = _worker_plane(credential)
    else:
        parsed = parse_role_token(credential) if held is not KeyRole.AGENT else None
        if parsed is None or parsed.plane is None:
            raise ConfigError(f"the {held.value if held else '?'} key opens no {plane.value.decode()}: that takes the "
                              "worker key or the cluster secret")
        root = parsed.plane
    return hmac.new(root, plane.value, hashlib.sha256).digest()


def is_cluster_secret(credential: bytes, candidate: bytes) -> bool:
    """Whether `candidate` is the run's cluster secret, checked by the holder of `credential` (the secret, or a
    worker key: the candidate must derive its worker-plane key; a worker so checks the secret without holding it)."""
    if role_of(candidate) is not KeyRole.CLUSTER:
        return False
    if role_of(credential) is KeyRole.CLUSTER:
        return hmac.compare_digest(candidate, credential)
    parsed = parse_role_token(credential)
    return parsed is not None and parsed.plane is not None and hmac.compare_digest(_worker_plane(candidate), parsed.plane)


def _curve_public_hex(secret: bytes) -> str:
    if not zmq.has("curve"):  # a libzmq without CURVE cannot encrypt anyway: the part is unused
        return "00" * 32
    public, _ = curve_server_keys(secret)
    return bytes(zmq.utils.z85.decode(public)).hex()


@dataclass(frozen=True)
class RoleKey:
    """A parsed role token: its role, the run's CURVE server public key (Z85) and, in a worker key, the
    worker-plane key."""

    role: KeyRole
    token: bytes
    curve_public: bytes
    plane: bytes | None = None

    @property
    def curve_public_hex(self) -> str:
        return bytes(zmq.utils.z85.decode(self.curve_public)).hex()


def parse_role_token(data: bytes) -> RoleKey | None:
    """The role key `data` holds, or None when it is not a role token (a cluster secret, say).
    A token that names a role but is malformed is a ConfigError naming what is wrong."""
    text = data.decode(errors="replace").strip()
    if not text.startswith(TOKEN_PREFIX) or text.startswith(AGENT_PREFIX):
        return None
    role_name, sep, rest = text[len(TOKEN_PREFIX):].partition("-")
    roles = {r.value: r for r in ROLE_KEYS}
    if not sep or role_name not in roles:
        return None
    parts = rest.split(":")
    want = 3 if role_name == KeyRole.WORKER.value else 2
    try:
        raw = [bytes.fromhex(part) for part in parts]
        ok = len(parts) == want and len(parts[0]) == 64 and all(len(r) == 32 for r in raw[1:])
    except ValueError:
        ok = False
    if not ok:
        shape = ":<64 hex>" * (want - 1)
        raise ConfigError(f"a malformed {role_name} key (expected earl-{role_name}-<64 hex>{shape}, as "
                          "`earl-stream keys derive` prints it)")
    return RoleKey(roles[role_name], text.encode(), zmq.utils.z85.encode(raw[1]), raw[2] if want == 3 else None)


def role_of(data: bytes | None) -> KeyRole | None:
    """The role of a loaded credential: a role token's, an agent key's, else the cluster secret's (None: none)."""
    if data is None:
        return None
    if data.startswith(AGENT_PREFIX.encode()):
        return KeyRole.AGENT
    parsed = parse_role_token(data)
    return parsed.role if parsed is not None else KeyRole.CLUSTER


def key_for(credential: bytes | None, role: KeyRole) -> bytes | None:
    """What a command that needs `role` signs with: the credential itself when it is a role key (the
    supervisor says so if that role is not enough), else `role`'s token derived from the cluster secret.
    None stays None (an open run)."""
    if credential is None or role is KeyRole.CLUSTER or role_of(credential) is not KeyRole.CLUSTER:
        return credential
    return role_token(credential, role)


def keyring(secret: bytes, generations: Mapping[KeyRole, int] | None = None) -> dict[KeyRole, bytes]:
    """Every control-plane key of the run, by role, at the roles' current `generations` (default 0): what
    the supervisor verifies messages against."""
    gens = generations or {}
    return {KeyRole.CLUSTER: secret, **{role: role_token(secret, role, gens.get(role, 0)) for role in ROLE_KEYS}}


def write_key_file(path: Path, key: bytes) -> Path:
    """`key` in a new file readable only by this user (a fresh file: never written through a link)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".new")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key + b"\n")
    os.replace(tmp, path)  # whole or absent: a worker re-reading it never sees half a key
    return path


# -- agent keys -------------------------------------------------------------------------------------------


class AgentKeyError(EarlError):
    """An agent key that does not hold: malformed, not this run's, expired, or for another episode."""


def _agent_mac(credential: bytes, episode: str, expiry: int) -> str:
    root = hmac.new(plane_key(credential, Plane.AGENT), _AGENT_CONTEXT, hashlib.sha256).digest()
    return hmac.new(root, f"{episode}\n{expiry}".encode(), hashlib.sha256).hexdigest()


def agent_key(secret: bytes, episode: str, ttl_s: float, now: float | None = None) -> str:
    """An agent key for `episode`, valid for `ttl_s` seconds from `now` (`secret`: the cluster secret or a
    worker key)."""
    if not episode or any(c.isspace() for c in episode):
        raise ConfigError(f"an episode id is a non-empty string without spaces, got {episode!r}")
    if ttl_s <= 0:
        raise ConfigError(f"an agent key's lifetime must be > 0 seconds, got {ttl_s}")
    expiry = int((time.time() if now is None else now) + ttl_s + 0.999)
    return f"{AGENT_PREFIX}{expiry}-{_agent_mac(secret, episode, expiry)}-{episode}"


def check_agent_key(secret: bytes, token: str, now: float | None = None) -> str:
    """The episode an agent key is for; AgentKeyError says why it does not hold."""
    expiry_text, _, rest = token.removeprefix(AGENT_PREFIX).partition("-")
    mac, _, episode = rest.partition("-")
    if not token.startswith(AGENT_PREFIX) or not expiry_text.isdigit() or len(mac) != 64 or not episode:
        raise AgentKeyError("a malformed agent key (earl-agent-EXPIRY-MAC-EPISODE)")
    expiry = int(expiry_text)
    if not hmac.compare_digest(mac, _agent_mac(secret, episode, expiry)):
        raise AgentKeyError("an agent key that is not this run's (or was altered)")
    now = time.time() if now is None else now
    if now > expiry:
        raise AgentKeyError(f"the agent key of episode {episode!r} expired {now - expiry:.0f}s ago")
    return episode
