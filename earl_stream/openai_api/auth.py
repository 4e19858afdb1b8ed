"""Who may call the OpenAI endpoint: the bearer token of each request (earl_stream/security/keys.py says who holds which key).

- No cluster secret (an open run): anyone.
- The cluster secret: any request, in any episode or none (a user's own agent program, as before). A worker
  holding only the worker key checks it without holding it (`keys.is_cluster_secret`).
- An agent key (`keys.agent_key`): the requests of its own episode until the key expires; a request naming
  another episode is refused (403), one naming none is filed under the key's episode, and `GET /v1/models`
  is allowed (agent frameworks ask it first). A key this worker made for an episode it runs is refused as
  soon as that episode has ended (`ended`), not only at its expiry: a replayed key opens nothing. Keys made
  with `earl-stream keys derive agent --episode ID` serve a user's own agent program until they expire.
- Anything else, a role key included, is refused (401) with what was wrong.

The rollout worker makes each episode's key (`EndpointAuth.agent_key`) and hands it to the agent program as
its `api_key`; the agent never sees the cluster secret.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from earl_stream.security.keys import AGENT_PREFIX, AgentKeyError, agent_key, check_agent_key, is_cluster_secret, role_of


@dataclass(frozen=True)
class Grant:
    """What a request's token allows: `episode` is an agent key's episode (None: any request)."""

    episode: str | None = None


class Denied(Exception):
    """A request refused for its token: `status` (401 or 403), `code` (the OpenAI error code)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class EndpointAuth:
    """Checks bearer tokens against the worker's credential (the cluster secret or the worker key); remembers the
    agent keys it made until they expire."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self._made: dict[str, float] = {}  # episode -> expiry of the key made for it, while the episode runs
        self._ended: dict[str, float] = {}  # episode -> expiry, for keys whose episode ended before it

    @property
    def open(self) -> bool:
        return self._secret is None

    def agent_key(self, episode: str, ttl_s: float) -> str:
        """The key an agent program uses for `episode` ("none" on an open endpoint)."""
        if self._secret is None:
            return "none"
        self._made[episode] = time.time() + ttl_s + 1.0
        return agent_key(self._secret, episode, ttl_s)

    def ended(self, episode: str) -> None:
        """`episode` (run by this worker) ended: its key opens nothing from now on."""
        expiry = self._made.pop(episode, None)
        now = time.time()
        if expiry is not None and expiry > now:
            self._ended[episode] = expiry
        for gone in [e for e, t in self._ended.items() if t <= now]:  # expired keys are refused anyway
            del self._ended[gone]

    def grant(self, authorization: str) -> Grant:
        """What the `Authorization` header's token allows; `Denied` says why it allows nothing."""
        if self._secret is None:
            return Grant()
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Denied(401, "missing API key: pass this episode's agent key (or the cluster secret) as the bearer "
                         "token", "invalid_api_key")
        if is_cluster_secret(self._secret, token.encode()):
            return Grant()
        if token.startswith(AGENT_PREFIX):
            try:
                episode = check_agent_key(self._secret, token)
            except AgentKeyError as exc:
                raise Denied(401, f"{exc}: pass a current agent key of this run", "invalid_api_key") from None
            if episode in self._ended:
                raise Denied(401, f"the agent key of episode {episode!r} is no longer valid: that episode has ended",
                             "invalid_api_key")
            return Grant(episode)
        role = role_of(token.encode())
        if role is not None and role.value != "cluster":
            raise Denied(401, f"the {role.value} key is not accepted by the OpenAI endpoint: it takes an episode's "
                         "agent key or the cluster secret", "invalid_api_key")
        raise Denied(401, "wrong API key: pass this episode's agent key (or the cluster secret) as the bearer token",
                     "invalid_api_key")

    @staticmethod
    def episode_of(grant: Grant, asked: str) -> str:
        """The episode a request is filed under: `asked` (its header or `user` field), which an agent key's
        grant must match (403 otherwise); a request naming none gets the key's episode."""
        if grant.episode is None or asked == grant.episode:
            return asked
        if not asked:
            return grant.episode
        raise Denied(403, f"this agent key is for episode {grant.episode!r}, not {asked!r}: an agent key is valid "
                     "only for its own episode's requests", "wrong_episode")
