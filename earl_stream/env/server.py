"""Environment servers: any registered environment run as a process of its own, and `RemoteEnv`, the
environment a rollout worker plays in its place.

`earl-stream env serve SPEC --bind HOST:PORT` runs `EnvServer`: a ZMQ ROUTER speaking the control
plane's framing (msgspec messages signed with the environment servers' key, `env_key`: derived from the
cluster secret or a worker key alike, `earl_stream.security.keys`) around an
`EnvHost` (`earl_stream.env.host`): each episode is one environment instance on the server, opened by
`EnvOpen` (reset), driven by `EnvStep`, closed by `EnvClose` or when it is done; instances idle for
`idle_s` are dropped (their worker died). Requests run concurrently, so a slow episode does not hold the
others up.

`RemoteEnv` (registry name `remote`, params {address, timeout_s}) is the worker's side: every call has
a timeout, so a server that dies or hangs fails only the episodes it serves (EnvError, which the agent
loop turns into a failed episode, whose group the supervisor issues again). Attach one to a live run
with `earl-stream env attach NAME --address HOST:PORT`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from earl_stream import metrics as M
from earl_stream.env import StepResult
from earl_stream.env.host import (
    EnvClose,
    EnvClosed,
    EnvFailed,
    EnvHost,
    EnvOpen,
    EnvOpened,
    EnvStep,
    EnvStepped,
    failure,
    opened_observation,
    stepped_result,
)
from earl_stream.env.images import Observation
from earl_stream.errors import EnvError
from earl_stream.protocol import Msg, normalize_address
from earl_stream.security import encryption
from earl_stream.security.keys import Plane, plane_key
from earl_stream.security.secret import Refusal, ReplayGuard, check, load_secret, refusal_text, sign, verify

__all__ = ["EnvServer", "RemoteEnv"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


_Any = EnvOpen | EnvOpened | EnvStep | EnvStepped | EnvClose | EnvClosed | EnvFailed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Any)


def env_key(credential: bytes | None) -> bytes | None:
    """The key environment servers and their clients sign with, from the cluster secret or a worker key (the
    same from both: `security.keys.plane_key`); None: an open server."""
    return None if credential is None else plane_key(credential, Plane.ENV)


class EnvServer:
    """Serves environment `spec` (built with `params`) on `bind` ("HOST:PORT")."""

    def __init__(self, spec: str, params: dict[str, Any] | None = None, *, bind: str = "127.0.0.1:0",
                 secret: bytes | None = None, idle_s: float = 600.0, encrypt: bool | None = None) -> None:
        self.spec, self.params = spec, dict(params or {})
        self.host = EnvHost(spec, self.params, idle_s=idle_s)  # fails now, at start, if it cannot be built
        self.secret = env_key(secret)
        self.guard = ReplayGuard()  # a replayed or stale request is refused like an unsigned one
        self.idle_s = idle_s
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if encryption.encrypt_enabled(encrypt):
            encryption.curve_server(self._sock, secret)
        endpoint = normalize_address(bind)
        if endpoint.rsplit(":", 1)[1] == "0":
            port = self._sock.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"
        else:
            self._sock.bind(endpoint)
        self.address = endpoint.split("://", 1)[1]
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Answer requests until `stop` is set (forever without one)."""
        stop = stop or asyncio.Event()
        log.info("serving environment %s at %s", self.spec, self.address)
        try:
            while not stop.is_set():
                if not await self._sock.poll(500):
                    self.host.reap()
                    continue
                frames = await self._sock.recv_multipart()
                task = asyncio.create_task(self._answer(frames[0], frames[-1]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            for task in list(self._tasks):
                task.cancel()
            self._sock.close(0)
            self._ctx.term()

    async def _answer(self, ident: bytes, frame: bytes) -> None:
        payload = check(self.secret, frame, self.guard)
        if isinstance(payload, Refusal):
            M.SECURITY_REFUSED.labels("env", payload.value).inc()
            reply: Msg = EnvFailed(message=refusal_text(payload, self.guard.window_s))
            await self._sock.send_multipart([ident, b"", _encoder.encode(reply)])
            return
        try:
            reply = await self.host.handle(_decoder.decode(payload))
        except Exception as exc:  # the environment is user code: its failure is the episode's, not the server's
            reply = failure(exc)
        await self._sock.send_multipart([ident, b"", sign(self.secret, _encoder.encode(reply))])


class RemoteEnv:
    """An environment served by `earl-stream env serve` at `address` (see the module docstring).

    Its options (system prompt, turn lengths) are the served environment's, known after `reset`.
    """

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not isinstance(address, str) or ":" not in address:
            raise EnvError(f"remote environment needs address HOST:PORT, got {address!r}")
        self.address = normalize_address(address)
        self.timeout_s = float(timeout_s)
        self.credential = load_secret()  # the cluster secret or a worker key: CURVE's server key comes from it
        self.secret = env_key(self.credential)
        self.episode = uuid.uuid4().hex
        self.system_prompt: str | None = None
        self.max_turn_tokens = 32
        self.max_episode_tokens: int | None = None

    async def _call(self, msg: Msg) -> Any:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if encryption.encrypt_enabled():
                encryption.curve_client(sock, self.credential)
            sock.connect(self.address)
            await sock.send_multipart([b"", sign(self.secret, _encoder.encode(msg))])
            if not await sock.poll(int(self.timeout_s * 1000)):
                raise EnvError(f"environment server {self.address} did not answer within {self.timeout_s:.0f}s")
            frame = (await sock.recv_multipart())[-1]
        finally:
            sock.close(0)
        payload = verify(self.secret, frame)
        try:
            reply = _decoder.decode(payload if payload is not None else frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise EnvError(f"{self.address} is not an environment server, or not signed with our cluster secret") from None
        if isinstance(reply, EnvFailed):
            raise EnvError(f"environment server {self.address}: {reply.message}")
        if payload is None:
            raise EnvError(f"the reply of environment server {self.address} is not signed with our cluster secret")
        return reply

    async def reset(self, seed: int) -> str | Observation:
        opened: EnvOpened = await self._call(EnvOpen(episode=self.episode, seed=seed))
        self.system_prompt, self.max_turn_tokens = opened.system_prompt, opened.max_turn_tokens
        self.max_episode_tokens = opened.max_episode_tokens
        return opened_observation(opened, f"environment server {self.address}")

    async def step(self, action_text: str) -> StepResult:
        stepped: EnvStepped = await self._call(EnvStep(episode=self.episode, action=action_text))
        return stepped_result(stepped, f"environment server {self.address}")

    async def close(self) -> None:
        """Tell the server the episode is over (it also drops idle ones by itself)."""
        await self._call(EnvClose(episode=self.episode))
