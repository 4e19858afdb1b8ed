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

from earl_stream.errors import ConfigError, ControlPlaneTimeout, ProtocolError
from earl_stream.jitter import jitter
from earl_stream.security import encryption
from earl_stream.security.secret import ReplayGuard, load_secret, sign, verify
from earl_stream.store.schema import SampleMeta

# 2: plans travel as typed structs (TrainerPlan with a claim, RolloutPlan with a heartbeat), PlanAdopted
# 3: Scale/ScaleReply (the elastic rollout pool), HeartbeatReply.drain/drained; later, additive (defaults, so
#    still 3): RecoverSamples/Recovered, HeartbeatReply.checkpoint_version, Registered.run_id (durable experience)
PROTOCOL_VERSION = 3
TRAINER_DTYPES = ("fp32", "bf16")
# policy versions a trainer rank keeps published in its shard node (a third is published before the oldest goes)
WEIGHT_VERSIONS_KEPT = 2
log = logging.getLogger(__name__)


class Role(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAINER = "trainer"
    CLIENT = "client"  # status / env CLI


def plan_name(dp: int, fsdp: int, tp: int, sp: int, ep: int = 1) -> str:
    """`dp2`, `fsdp2`, `tp2`, `fsdp2_sp2`, `dp2_tp2`, `ep2`, `fsdp2_ep2`, ...: the degrees > 1 in the order
    dp, fsdp, tp, sp, ep; `dp1` for a single rank."""
    parts = [f"{k}{n}" for k, n in (("dp", dp), ("fsdp", fsdp), ("tp", tp), ("sp", sp), ("ep", ep)) if n > 1]
    return "_".join(parts) or "dp1"


class TrainerPlan(msgspec.Struct, frozen=True):
    """The trainer pool's parallel plan, version `version`, sized for `design_seq_len`-token episodes.

    A pool of `world` = dp x fsdp x tp x sp x ep ranks. `dp`: data-parallel replicas (weights replicated,
    gradients all-reduced); `fsdp`: FSDP2 shard degree over data ranks (1 = no FSDP; under FSDP the
    parameters, gradients and optimizer states are sharded over fsdp x sp ranks, torchtitan's
    dp_shard x cp, and under ep over fsdp x ep ranks); `tp`: tensor parallel; `sp`: Ulysses sequence
    parallel; `ep`: expert parallel (the experts of a mixture-of-experts model sharded over ep ranks,
    tokens dispatched by all-to-all). The `data_ranks` (dp x fsdp x ep) get different rows; the tp x sp
    ranks of one data rank get the same rows (sp ranks their token slices). `micro_batch_tokens`: the
    tokens one micro-batch materialises over its sp ranks, `store.layout.materialised_tokens` (packed:
    its rows' total length with the alignment padding to a multiple of sp; unpacked: rows x longest
    row, padded; the memory model's b x s: b = 1 and s = the packed length when packed);
    `predicted_peak_bytes`: the memory model's per-device peak for the worst micro-batch under that
    bound. `dtype`: "fp32", or "bf16" (bf16 compute, fp32 master weights and optimizer state).
    `step`: the step at which the supervisor made the plan.
    """

    version: int
    dp: int
    fsdp: int
    tp: int
    sp: int
    micro_batch_tokens: int
    recompute: bool
    dtype: str
    design_seq_len: int
    predicted_peak_bytes: int
    reason: str
    step: int
    ep: int = 1  # expert parallel: the experts of each MoE layer sharded over ep ranks (which are data ranks)

    def __post_init__(self) -> None:  # msgspec turns a ValueError into a decode error: bad plans never arrive
        bad = [f"{k}={getattr(self, k)}" for k in ("version", "dp", "fsdp", "tp", "sp", "design_seq_len", "ep")
               if getattr(self, k) < 1]
        if self.micro_batch_tokens < self.sp:
            bad.append(f"micro_batch_tokens={self.micro_batch_tokens} < sp={self.sp}")
        if self.dtype not in TRAINER_DTYPES:
            bad.append(f"dtype={self.dtype!r} (choose one of {list(TRAINER_DTYPES)})")
        if bad:
            raise ValueError("invalid trainer plan: " + ", ".join(bad))

    @property
    def world(self) -> int:
        """Ranks the plan runs on."""
        return self.dp * self.fsdp * self.tp * self.sp * self.ep

    @property
    def data_ranks(self) -> int:
        """Ranks that get different rows of a claim (the layout's dp size; ep ranks are data ranks)."""
        return self.dp * self.fsdp * self.ep

    @property
    def rank_micro_batch_tokens(self) -> int:
        """The micro-batch budget in `store.layout.partition`'s units: tokens one sp rank materialises."""
        return self.micro_batch_tokens // self.sp

    @property
    def name(self) -> str:
        """`dp2`, `fsdp2`, `tp2`, `fsdp2_sp2`, `dp2_tp2`, `ep2`, ...: the degrees > 1 in the order dp,
        fsdp, tp, sp, ep; `dp1` for a single rank."""
        return plan_name(self.dp, self.fsdp, self.tp, self.sp, self.ep)

    def to_dict(self) -> dict[str, Any]:
        """The fields plus `name`, `world` and `rank_micro_batch_tokens` (status, logs)."""
        return {**msgspec.structs.asdict(self), "name": self.name, "world": self.world,
                "rank_micro_batch_tokens": self.rank_micro_batch_tokens}


class RolloutPlan(msgspec.Struct, frozen=True):
    """A rollout engine's capacity, version `version`, sized for `design_seq_len`-token episodes: per
    engine of `engine_tp` devices (`replicas` engines fill the pool's devices) at most
    `max_concurrent_sequences` sequences and `kv_budget_tokens` tokens of KV cache at once. Workers stop
    an episode once its context reaches `max_episode_tokens` (the longest a trainer plan or the KV
    budget can hold; 0 = no bound). `memory_bytes` is the engine memory per device it was sized for;
    `sizing` says what it admits and why."""

    version: int
    max_concurrent_sequences: int
    kv_budget_tokens: int
    design_seq_len: int
    engine_tp: int
    replicas: int
    reason: str
    step: int
    max_episode_tokens: int = 0
    memory_bytes: int = 0
    sizing: str = ""

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in ("version", "max_concurrent_sequences", "kv_budget_tokens",
                                                    "design_seq_len", "engine_tp", "replicas") if getattr(self, k) < 1]
        if bad:
            raise ValueError("invalid rollout plan: " + ", ".join(bad))


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
    ray_node_id: str = ""  # the Ray node it runs on (`up --launcher ray`); "" elsewhere
    openai_url: str = ""  # a rollout worker's OpenAI-compatible endpoint (http://HOST:PORT/v1); "" if none


class Registered(Msg, tag="registered", frozen=True):
    worker_id: str = ""
    config_json: str = ""
    policy_version: int = 0
    weights_address: str = ""
    run_id: str = ""  # names the run (its ledger) for as long as its state lives: persisted samples must match it


class Heartbeat(Msg, tag="heartbeat", frozen=True):
    worker_id: str = ""
    stats: dict[str, float] = {}
    envs_version: int = -1  # the environment set this worker has loaded
    env_errors: dict[str, str] = {}  # environment name -> why this worker cannot load it
    leaving: bool = False  # its host stopped it (SIGTERM with --drain-on-term): drain it, then let it leave
    # a rollout worker's built-in engine, its latest allocation failure shed (stats["oom_sheds"] counts them): the
    # bytes the failed allocation asked for and what the engine's process held then (0: unknown, or none shed)
    oom_attempted_bytes: int = 0
    oom_in_use_bytes: int = 0


class HeartbeatReply(Msg, tag="heartbeat_reply", frozen=True):
    policy_version: int = 0
    weights_address: str = ""
    stop: bool = False
    free_sample_ids: list[str] = []
    known: bool = True  # False: the supervisor does not know this worker; register again
    envs_version: int = 0
    envs_json: str = ""  # the environment set, sent only when the worker's is older
    plan: RolloutPlan | None = None  # the rollout pool's current plan (None: the selector is off)
    drain: bool = False  # take no new prompts; finish the groups held and keep serving their samples
    drained: bool = False  # (with stop) every sample of this worker is trained and released: exit now
    # store.weight_sync (store/weight_route.py): relay = pull the version with store.relay.sync_weights and
    # serve it onwards; weights_via = the rollout worker's shard node to pull it from ("" = the trainer)
    weights_relay: bool = False
    weights_via: str = ""
    # the step of the trainer's latest checkpoint (-1: none yet): a rollout worker persists the samples it
    # holds (store/durable.py) each time it grows
    checkpoint_version: int = -1


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
    group_seed: str = "auto"  # EnvSpec.group_seed


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


class EvalTask(msgspec.Struct, frozen=True):
    """One evaluation episode (`supervisor.eval_rounds`): sample `sample` of held-out item `item` of `env`
    (`spec` built with `params_json`, reset with `seed`), for the round of policy version `version` (play it
    with weights at least that new). Never trained on: its result goes back in `PutEval`, not to the store."""

    task_id: str
    version: int
    env: str
    spec: str
    params_json: str
    item: int
    seed: int
    sample: int
    temperature: float
    success_outcomes: list[str] = []


class EvalResult(msgspec.Struct, frozen=True):
    task_id: str
    reward: float
    success: bool
    outcome: str
    tokens: int = 0
    policy_version: int = -1  # the oldest policy version of its tokens


class Prompts(Msg, tag="prompts", frozen=True):
    prompts: list[Prompt] = []
    eval_tasks: list[EvalTask] = []  # evaluation episodes to play instead (between training groups)


class PutEval(Msg, tag="put_eval", frozen=True):
    worker_id: str = ""
    results: list[EvalResult] = []


class PutMeta(Msg, tag="put_meta", frozen=True):
    worker_id: str = ""
    rows: list[SampleMeta] = []
    failed_groups: list[str] = []  # groups the worker could not finish (env crash): re-issue


class RecoverSamples(Msg, tag="recover_samples", frozen=True):
    """A restarted rollout worker serves samples it had persisted (store/durable.py); `rows` point at
    its new shard node, `source` names the file they came from (for the log)."""

    worker_id: str = ""
    rows: list[SampleMeta] = []
    source: str = ""


class Recovered(Msg, tag="recovered", frozen=True):
    accepted: list[str] = []  # sample ids the ledger takes back (trained instead of re-played)
    refused: list[str] = []  # the others: no longer wanted (trained, re-played, unknown); free them


class Claim(Msg, tag="claim", frozen=True):
    worker_id: str = ""
    step: int = 0
    num_groups: int = 1
    min_policy_version: int = 0


class Claimed(Msg, tag="claimed", frozen=True):
    step: int = 0
    ready: bool = False
    table_ipc: bytes = b""
    plan: TrainerPlan | None = None  # the trainer pool's plan for this step; None = keep yours
    waiting: str = ""  # not ready: what the supervisor sees that may explain it (e.g. episodes refused as too long)


class PlanAdopted(Msg, tag="plan_adopted", frozen=True):
    """Trainer rank 0, once the pool adopted plan `version` at the boundary before training `step`."""

    worker_id: str = ""
    version: int = 0
    step: int = 0


class TrainerOom(Msg, tag="trainer_oom", frozen=True):
    """Trainer rank 0: the pool abandoned `step` under plan `plan_version` because a rank failed to allocate
    (no update applied). The evidence the supervisor corrects its memory model with: the claim's shape
    (`rows`, `tokens` in all, the `longest` row's tokens), the bytes the failed allocation asked for
    (`attempted_bytes`, 0 = the allocator did not say) and the fullest rank's peak before it (`peak_bytes`,
    0 = unknown). Answered by `OomReplanned`; the same report twice (a retry) gets the same answer."""

    worker_id: str = ""
    step: int = 0
    plan_version: int = 0
    rows: int = 0
    tokens: int = 0
    longest: int = 0
    attempted_bytes: int = 0
    peak_bytes: int = 0
    error: str = ""  # the allocator's message, first line


class OomReplanned(Msg, tag="oom_replanned", frozen=True):
    """The supervisor's answer to `TrainerOom`: `plan` is the plan to retry the step under (its next
    `Claimed` carries it, with the same rows less those no plan holds any more, refused as too long; with
    every row refused, a fresh batch), None when the supervisor has no memory model to re-plan with (the
    selector is off; `message` says why; the rank then fails as it would without recovery)."""

    plan: TrainerPlan | None = None
    message: str = ""


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


class EvalPending(Msg, tag="eval_pending", frozen=True):
    """The trainer, after its last step: is an evaluation round (eval.every; the final version's one included)
    still being played?"""

    worker_id: str = ""


class EvalPendingReply(Msg, tag="eval_pending_reply", frozen=True):
    pending: bool = False
    version: int = -1  # the oldest unfinished round's version (-1: none)
    done: int = 0  # its episodes back
    total: int = 0


class Scale(Msg, tag="scale", frozen=True):
    """Set the desired size of a pool (only the rollout pool scales live). Scaling down drains the
    surplus workers (no new prompts; each exits once its samples are trained and released); scaling
    up first cancels drains, then leaves `to_start` workers for a launcher to start."""

    role: Role = Role.ROLLOUT
    replicas: int = 0


class ScaleReply(Msg, tag="scale_reply", frozen=True):
    replicas: int = 0  # the desired size now held by the supervisor
    active: int = 0  # live workers of the pool that are not draining (after this request)
    draining: list[str] = []  # worker ids draining now
    undrained: list[str] = []  # worker ids whose drain this request cancelled
    to_start: int = 0  # workers a launcher should start to reach `replicas`


class RevokeKey(Msg, tag="revoke_key", frozen=True):
    """Revoke a role's key (`worker`, `operator`: its generation is bumped) or one worker id (`keys revoke`;
    security/keys.py says what each guards)."""

    target: str = ""


class RevokeReply(Msg, tag="revoke_reply", frozen=True):
    message: str = ""


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
    | Release | PlanAdopted | PublishVersion | Finished | StatusRequest | StatusReply | Ack | ErrorReply | EnvAttach | EnvDetach
    | EnvList | EnvListReply | RecentEpisodes | RecentEpisodesReply | Scale | ScaleReply | RecoverSamples | Recovered
    | PutEval | TrainerOom | OomReplanned | RevokeKey | RevokeReply | EvalPending | EvalPendingReply
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


class KeyRefused(ProtocolError):
    """The supervisor refused the key we signed with (not this run's, or revoked)."""


class ControlClient:
    """Request/reply over a ZMQ DEALER socket, thread-safe, every call with a timeout.

    On a timeout the socket is rebuilt so that a late reply can never be taken for the answer to
    the next request.
    """

    def __init__(self, address: str, *, timeout_s: float = 5.0, secret: bytes | None = None,
                 encrypt: bool | None = None, key_file: str | None = None) -> None:
        """`encrypt`: CURVE to the server (None: $EARL_STREAM_ENCRYPT; `earl_stream.security.encryption`).
        `key_file`: where `secret` came from; when the supervisor refuses our key, the file is read again and a
        new key in it (the worker key after `keys revoke worker`, security/keys.py) is tried once."""
        self.address = normalize_address(address)
        self.secret = secret
        self.key_file = key_file
        self.encrypt = encryption.encrypt_enabled(encrypt)
        self.timeout_s = timeout_s
        self._guard = ReplayGuard()  # a reply must be fresh and never seen before
        self._ctx: zmq.Context = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.encrypt:
                encryption.curve_client(sock, self.secret)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def call(self, msg: Msg, *, timeout_s: float | None = None, what: str | None = None) -> Any:
        try:
            return self._call(msg, timeout_s, what)
        except KeyRefused:
            if not self._reload_key():
                raise
            log.warning("the supervisor at %s refused our key: using the new one in %s", self.address, self.key_file)
            return self._call(msg, timeout_s, what)

    def _reload_key(self) -> bool:
        """Whether `key_file` now holds another key (then taken)."""
        try:
            key = load_secret(self.key_file) if self.key_file else None
        except ConfigError:
            return False
        if key is None or key == self.secret:
            return False
        self.secret = key
        return True

    def _call(self, msg: Msg, timeout_s: float | None, what: str | None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        jitter()  # tests of timing independence only (EARL_STREAM_JITTER_MS)
        with self._lock:
            sock = self._socket()
            sock.send_multipart([b"", sign(self.secret, encode(msg))])
            if not sock.poll(int(timeout * 1000)):
                sock.close(0)
                self._sock = None
                raise ControlPlaneTimeout(
                    f"no answer from the supervisor at {self.address} within {timeout:.0f}s "
                    f"(waiting for the reply to {what or type(msg).__name__})"
                    + ("" if self.encrypt else f"; {encryption.HINT}")
                )
            frames = sock.recv_multipart()
        payload = verify(self.secret, frames[-1], self._guard)
        if payload is None:
            try:
                refused = decode(frames[-1])
            except ProtocolError:
                refused = None
            if isinstance(refused, ErrorReply):
                raise KeyRefused(f"the supervisor at {self.address} refused us: {refused.message} "
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
