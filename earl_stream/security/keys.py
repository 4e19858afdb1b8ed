"""Scoped credentials, all derived from the cluster secret: which key a holder gets, and what it proves.

One file (the cluster secret) still sets up a cluster; every other key is derived from it, so nothing
else has to be distributed, and a holder of a derived key cannot derive the secret or another role's key.

- **cluster secret** (`KeyRole.CLUSTER`): what `up` and the processes it starts hold; allowed everything,
  and the only key of the data plane (shard nodes) and of environment servers.
- **worker key** (`KeyRole.WORKER`): registers rollout workers and trainer ranks and sends what they send
  (heartbeats, metadata, claims, releases, weight versions); never scale, env attach/detach or status.
- **operator key** (`KeyRole.OPERATOR`): `scale`, `env attach|detach`, stopping the run, and what the
  read-only key may do.
- **read-only key** (`KeyRole.READONLY`): `status`, `env list`, `episodes tail|export` (metadata; the
  transcripts live on the data plane) and metrics scraping (its token is the metrics bearer token).
- **agent key** (`KeyRole.AGENT`): one episode's requests to one rollout worker's OpenAI endpoint, while that
  episode runs there and until its expiry; no control-plane message at all.

A role key is a printable token, `earl-ROLE-<64 hex key>:<64 hex>`: the second part is the public CURVE key of
the run's control-plane servers (`encryption`), so that a holder of a role key can connect to an encrypting
supervisor. Control messages are signed with the whole token as the HMAC key (`security.sign`); the supervisor
derives every role's token and finds the one a message verifies under (`security.check_keys`). An agent key is
`earl-agent-<expiry>-<64 hex MAC>-<episode>`, a MAC of the episode and its expiry (unix seconds) under a key
derived from the secret: the endpoint verifies it without keeping any list of issued keys.

Which message each role may send is the supervisor's (`supervisor/access.py`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import time
from dataclasses import dataclass

import zmq
import zmq.utils.z85

from earl_stream.errors import ConfigError, EarlError

TOKEN_PREFIX = "earl-"
_ROLE_CONTEXT = b"earl_stream role key v1:"
_AGENT_CONTEXT = b"earl_stream agent key v1"
AGENT_PREFIX = "earl-agent-"
_CURVE_CONTEXT = b"earl_stream control-plane CURVE server key v1"


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


def role_token(secret: bytes, role: KeyRole) -> bytes:
    """The token of `role` for the run holding `secret` (see the module docstring)."""
    if role not in ROLE_KEYS:
        raise ConfigError(f"no role key for {role.value!r}: roles with a key are {[r.value for r in ROLE_KEYS]}"
                          + ("; an agent key is per episode (keys derive agent --episode ID)" if role is KeyRole.AGENT
                             else ""))
    key = hmac.new(secret, _ROLE_CONTEXT + role.value.encode(), hashlib.sha256).hexdigest()
    return f"{TOKEN_PREFIX}{role.value}-{key}:{_curve_public_hex(secret)}".encode()


def _curve_public_hex(secret: bytes) -> str:
    if not zmq.has("curve"):  # a libzmq without CURVE cannot encrypt anyway: the part is unused
        return "00" * 32
    public, _ = curve_server_keys(secret)
    return bytes(zmq.utils.z85.decode(public)).hex()


@dataclass(frozen=True)
class RoleKey:
    """A parsed role token: its role and the run's CURVE server public key (Z85)."""

    role: KeyRole
    token: bytes
    curve_public: bytes


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
    key, colon, public_hex = rest.partition(":")
    try:
        ok = len(key) == 64 and colon and bytes.fromhex(key) is not None and len(bytes.fromhex(public_hex)) == 32
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"a malformed {role_name} key (expected earl-{role_name}-<64 hex>:<64 hex>, as "
                          "`earl-stream keys derive` prints it)")
    return RoleKey(roles[role_name], text.encode(), zmq.utils.z85.encode(bytes.fromhex(public_hex)))


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


def keyring(secret: bytes) -> dict[KeyRole, bytes]:
    """Every control-plane key of the run, by role: what the supervisor verifies messages against."""
    return {KeyRole.CLUSTER: secret, **{role: role_token(secret, role) for role in ROLE_KEYS}}


# -- agent keys -------------------------------------------------------------------------------------------


class AgentKeyError(EarlError):
    """An agent key that does not hold: malformed, not this run's, expired, or for another episode."""


def _agent_mac(secret: bytes, episode: str, expiry: int) -> str:
    root = hmac.new(secret, _AGENT_CONTEXT, hashlib.sha256).digest()
    return hmac.new(root, f"{episode}\n{expiry}".encode(), hashlib.sha256).hexdigest()


def agent_key(secret: bytes, episode: str, ttl_s: float, now: float | None = None) -> str:
    """An agent key for `episode`, valid for `ttl_s` seconds from `now`."""
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
