"""Control-plane messages (typed, versioned msgspec structs over ZMQ) and the client that sends them.

Only small things cross the control plane: registrations, heartbeats, metadata rows, claims (an
Arrow IPC table of metadata), plans, policy versions and status. Tensor bytes never do: they move
through the experience store (`earl_stream.store`). Nothing received is ever unpickled.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any

import msgspec
import zmq

from earl_stream.errors import ControlPlaneTimeout, ProtocolError
from earl_stream.security import sign, verify
from earl_stream.store.schema import SampleMeta

PROTOCOL_VERSION = 1
log = logging.getLogger(__name__)


class Role(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAINER = "trainer"
    CLIENT = "client"  # status / env CLI


class Msg(msgspec.Struct, tag_field="type", frozen=True):
    """Base of every control-plane message; `v` is the protocol version of the sender."""

    v: int = PROTOCOL_VERSION


class Register(Msg, tag="register", frozen=True):
    role: Role = Role.CLIENT
    host: str = ""
    pid: int = 0
    rank: int = -1
    shard_address: str = ""
    metrics_address: str = ""
    worker_id: str = ""  # set when re-registering after a reconnect


class Registered(Msg, tag="registered", frozen=True):
    worker_id: str = ""
    config_json: str = ""
    policy_version: int = 0
    weights_address: str = ""


class Heartbeat(Msg, tag="heartbeat", frozen=True):
    worker_id: str = ""
    stats: dict[str, float] = {}
    envs_version: int = -1  # the environment set this worker has loaded
    env_errors: dict[str, str] = {}  # environment name -> why this worker cannot load it


class HeartbeatReply(Msg, tag="heartbeat_reply", frozen=True):
    policy_version: int = 0
    weights_address: str = ""
    stop: bool = False
    free_sample_ids: list[str] = []
    known: bool = True  # False: the supervisor does not know this worker; register again
    envs_version: int = 0
    envs_json: str = ""  # the environment set, sent only when the worker's is older
    plan_json: str = ""  # the rollout pool's current plan (RolloutDecision.to_dict)


class RecentEpisodes(Msg, tag="recent_episodes", frozen=True):
    since: int = 0  # return rows the supervisor received after this cursor


class RecentEpisodesReply(Msg, tag="recent_episodes_reply", frozen=True):
    cursor: int = 0
    table_ipc: bytes = b""  # metadata rows (Arrow IPC); transcripts live with the producers


class EnvAttach(Msg, tag="env_attach", frozen=True):
    spec: str = ""
    name: str = ""
    weight: float = 1.0
    params: dict[str, Any] = {}


class EnvDetach(Msg, tag="env_detach", frozen=True):
    name: str = ""


class EnvList(Msg, tag="env_list", frozen=True):
    pass


class EnvListReply(Msg, tag="env_list_reply", frozen=True):
    envs_json: str = "[]"  # [{name, spec, weight, params, active, errors: {worker: message}, episodes}]


class Prompt(msgspec.Struct, frozen=True):
    """One prompt group to play: `group_size` episodes of `env` from `seed`."""

    group_id: str
    prompt_ordinal: int
    env: str
    seed: int
    group_size: int
    min_policy_version: int = 0  # play it with weights at least this new


class RequestPrompts(Msg, tag="request_prompts", frozen=True):
    worker_id: str = ""
    max_groups: int = 1
    request_id: str = ""  # unique per request of this worker; a retry re-sends it and gets the same prompts


class Prompts(Msg, tag="prompts", frozen=True):
    prompts: list[Prompt] = []


class PutMeta(Msg, tag="put_meta", frozen=True):
    worker_id: str = ""
    rows: list[SampleMeta] = []
    failed_groups: list[str] = []  # groups the worker could not finish (env crash): re-issue


class Claim(Msg, tag="claim", frozen=True):
    worker_id: str = ""
    step: int = 0
    num_groups: int = 1
    min_policy_version: int = 0


class Claimed(Msg, tag="claimed", frozen=True):
    step: int = 0
    ready: bool = False
    table_ipc: bytes = b""
    plan_json: str = ""  # the trainer pool's plan for this step (PlanDecision.to_dict), "" = keep yours


class Release(Msg, tag="release", frozen=True):
    worker_id: str = ""
    step: int = 0
    lost_sample_ids: list[str] = []  # samples that could not be pulled (producer gone)
    # True: a checkpoint holds the step, its rows may be freed. False: trained only; a trainer that
    # resumes from an older checkpoint is served the step again, so the producers keep its rows
    checkpointed: bool = True


class PublishVersion(Msg, tag="publish_version", frozen=True):
    worker_id: str = ""
    version: int = 0
    weights_address: str = ""
    metrics: dict[str, float] = {}


class Finished(Msg, tag="finished", frozen=True):
    worker_id: str = ""
    reason: str = ""


class StatusRequest(Msg, tag="status", frozen=True):
    pass


class StatusReply(Msg, tag="status_reply", frozen=True):
    status_json: str = "{}"


class Ack(Msg, tag="ack", frozen=True):
    pass


class ErrorReply(Msg, tag="error", frozen=True):
    message: str = ""


AnyMsg = (
    Register | Registered | Heartbeat | HeartbeatReply | RequestPrompts | Prompts | PutMeta | Claim | Claimed
    | Release | PublishVersion | Finished | StatusRequest | StatusReply | Ack | ErrorReply | EnvAttach | EnvDetach
    | EnvList | EnvListReply | RecentEpisodes | RecentEpisodesReply
)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMsg)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Any:
    """Decode one message; anything that is not our protocol raises ProtocolError."""
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not an earl_stream control message: {exc}") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(f"control protocol version {msg.v} != ours ({PROTOCOL_VERSION})")
    return msg


def normalize_address(address: str) -> str:
    """Accept `tcp://host:port` or `host:port`."""
    return address if "://" in address else f"tcp://{address}"


class ControlClient:
    """Request/reply over a ZMQ DEALER socket, thread-safe, every call with a timeout.

    On a timeout the socket is rebuilt so that a late reply can never be taken for the answer to
    the next request.
    """

    def __init__(self, address: str, *, timeout_s: float = 5.0, secret: bytes | None = None) -> None:
        self.address = normalize_address(address)
        self.secret = secret
        self.timeout_s = timeout_s
        self._ctx: zmq.Context = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def call(self, msg: Msg, *, timeout_s: float | None = None, what: str | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            sock = self._socket()
            sock.send_multipart([b"", sign(self.secret, encode(msg))])
            if not sock.poll(int(timeout * 1000)):
                sock.close(0)
                self._sock = None
                raise ControlPlaneTimeout(
                    f"no answer from the supervisor at {self.address} within {timeout:.0f}s "
                    f"(waiting for the reply to {what or type(msg).__name__})"
                )
            frames = sock.recv_multipart()
        payload = verify(self.secret, frames[-1])
        if payload is None:
            try:
                refused = decode(frames[-1])
            except ProtocolError:
                refused = None
            if isinstance(refused, ErrorReply):
                raise ProtocolError(f"the supervisor at {self.address} refused us: {refused.message} "
                                    "(is the cluster secret the same?)")
            raise ProtocolError(f"the reply from {self.address} is not signed with our cluster secret")
        reply = decode(payload)
        if isinstance(reply, ErrorReply):
            raise ProtocolError(f"supervisor refused {type(msg).__name__}: {reply.message}")
        return reply

    def call_retry(self, msg: Msg, *, deadline_s: float, what: str) -> Any:
        """Retry a call through supervisor restarts until `deadline_s` has passed."""
        end = time.monotonic() + deadline_s
        while True:
            try:
                return self.call(msg, timeout_s=min(self.timeout_s, max(0.5, end - time.monotonic())), what=what)
            except ControlPlaneTimeout:
                if time.monotonic() >= end:
                    raise
                log.warning("supervisor at %s not answering (%s); retrying", self.address, what)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None
