"""The supervisor process: a ZMQ ROUTER that answers control-plane messages, keeps membership by
heartbeats and leases, and keeps the ledger (prompts, layout index, claims) and run statistics.

It never touches tensor bytes: producers keep their shards, consumers pull them directly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.config import RunConfig, config_to_json
from earl_stream.errors import ConfigError, ProtocolError
from earl_stream.security import sign, verify
from earl_stream.store.schema import SampleMeta, metas_to_table, table_to_ipc
from earl_stream.supervisor.envs import EnvEntry, EnvRegistry
from earl_stream.supervisor.ledger import Ledger, PromptState, outcome_of
from earl_stream.supervisor.planning import Planner

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Worker:
    worker_id: str
    role: P.Role
    host: str
    pid: int
    rank: int
    shard_address: str
    metrics_address: str
    last_seen: float
    alive: bool = True
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    envs_version: int = -1


class SupervisorState(msgspec.Struct):
    ledger: bytes
    envs: list[EnvEntry]
    envs_version: int
    env_episodes: dict[str, int]
    policy_version: int
    weights_address: str
    finished: bool
    workers: list[Worker]
    next_id: int
    trainer_metrics: dict[str, float]


class Supervisor:
    """Control-plane state machine; `handle` maps one request to one reply (no I/O)."""

    def __init__(self, cfg: RunConfig, *, address: str = "") -> None:
        self.cfg = cfg
        self.address = address
        self.metrics_address = ""
        self.config_json = config_to_json(cfg)
        t = cfg.trainer
        self.envs = EnvRegistry(cfg.envs)
        self.planner = Planner(cfg)
        self.env_episodes: dict[str, int] = {}
        self.ledger = Ledger(self.envs.usable_specs(), seed=cfg.seed, group_size=t.group_size, groups_per_step=t.groups_per_step,
                             max_staleness=t.max_staleness)
        self.workers: dict[str, Worker] = {}
        self.policy_version = 0
        self.weights_address = ""
        self.trainer_metrics: dict[str, float] = {}
        self.finished = False
        self.started = time.time()
        self.recent: deque[tuple[float, str, int, str]] = deque(maxlen=cfg.supervisor.stats_window)
        self.recent_rows: deque[tuple[int, SampleMeta]] = deque(maxlen=cfg.supervisor.stats_window)
        self.rows_seen = 0
        self.pending_free: dict[str, list[str]] = {}  # producer address -> sample ids to drop
        self._ids = 0

    # -- dispatch -----------------------------------------------------------------------------

    def handle(self, msg: Any, now: float) -> P.Msg:
        handler = getattr(self, "_on_" + type(msg).__name__.lower(), None)
        if handler is None:
            return P.ErrorReply(message=f"unexpected message {type(msg).__name__}")
        worker = self.workers.get(getattr(msg, "worker_id", ""))
        if worker is not None:
            worker.last_seen = now
        return handler(msg, now)

    def _on_register(self, msg: P.Register, now: float) -> P.Msg:
        wid = msg.worker_id if msg.worker_id in self.workers else f"{msg.role.value}-{self._ids}"
        if wid not in self.workers:
            self._ids += 1
        self.workers[wid] = Worker(wid, msg.role, msg.host, msg.pid, msg.rank, msg.shard_address,
                                   msg.metrics_address, now)
        if msg.role != P.Role.CLIENT:
            log.info("registered %s (pid %d on %s, shards at %s)", wid, msg.pid, msg.host, msg.shard_address or "-")
        return P.Registered(worker_id=wid, config_json=self.config_json, policy_version=self.policy_version,
                            weights_address=self.weights_address)

    def _on_heartbeat(self, msg: P.Heartbeat, now: float) -> P.Msg:
        worker = self.workers.get(msg.worker_id)
        if worker is None or not worker.alive:
            return P.HeartbeatReply(known=False, policy_version=self.policy_version)
        worker.stats = dict(msg.stats)
        worker.envs_version = msg.envs_version
        if msg.env_errors and self.envs.report(worker.worker_id, msg.env_errors):
            log.warning("%s cannot load %s: those environments get no new prompts", worker.worker_id, msg.env_errors)
            self.ledger.envs = self.envs.usable_specs()
        published = int(msg.stats.get("published_version", -1))
        if worker.role == P.Role.TRAINER and published >= 0 and published != self.policy_version:
            # the trainer is authoritative: after a supervisor restart from a slightly older snapshot,
            # its heartbeat brings the policy version back in line
            log.info("policy version %d (from %s's heartbeat; was %d)", published, worker.worker_id, self.policy_version)
            self.policy_version, self.weights_address = published, worker.shard_address
        free = self.pending_free.pop(worker.shard_address, [])
        envs_json = self.envs.specs_json() if msg.envs_version < self.envs.version else ""
        return P.HeartbeatReply(policy_version=self.policy_version, weights_address=self.weights_address,
                                stop=self.finished, free_sample_ids=free, envs_version=self.envs.version,
                                envs_json=envs_json, plan_json=self.planner.rollout_plan_json())

    def _on_requestprompts(self, msg: P.RequestPrompts, now: float) -> P.Msg:
        if self.finished or msg.worker_id not in self.workers:
            return P.Prompts(prompts=[])
        return P.Prompts(prompts=self.ledger.issue(msg.worker_id, msg.max_groups, msg.request_id))

    def _on_putmeta(self, msg: P.PutMeta, now: float) -> P.Msg:
        self.ledger.add_rows(msg.worker_id, msg.rows)
        self.ledger.fail_groups(msg.failed_groups)
        self.planner.add(msg.rows)
        for row in msg.rows:
            self.rows_seen += 1
            self.recent_rows.append((self.rows_seen, row))
            self.env_episodes[row.env] = self.env_episodes.get(row.env, 0) + 1
            self.recent.append((row.reward, outcome_of(row), row.total_tokens, row.env))
        return P.Ack()

    def _on_claim(self, msg: P.Claim, now: float) -> P.Msg:
        first = msg.step not in self.ledger.claims
        ipc, stale = self.ledger.claim(msg.step, msg.num_groups, msg.min_policy_version)
        self._queue_free(stale)
        if ipc is not None and first:
            self.planner.on_step(msg.step, ipc)  # a step boundary: the pools may adopt a new plan here
        return P.Claimed(step=msg.step, ready=ipc is not None, table_ipc=ipc or b"",
                         plan_json=self.planner.trainer_plan_json() if ipc is not None else "")

    def _on_release(self, msg: P.Release, now: float) -> P.Msg:
        if msg.checkpointed:
            self._queue_free(self.ledger.release(msg.step, msg.lost_sample_ids))
        else:
            self._queue_free(self.ledger.trained(msg.step, msg.lost_sample_ids))
        return P.Ack()

    def _on_publishversion(self, msg: P.PublishVersion, now: float) -> P.Msg:
        self.policy_version = msg.version  # the trainer is authoritative (a resume may roll back)
        self.weights_address = msg.weights_address
        self.trainer_metrics = dict(msg.metrics)
        self.planner.on_trained(msg.version - 1, self.trainer_metrics)  # refits the cost model now and then
        M.SUP_POLICY_VERSION.set(self.policy_version)
        return P.Ack()

    def _on_finished(self, msg: P.Finished, now: float) -> P.Msg:
        log.info("run finished (%s): telling workers to stop", msg.reason)
        self.finished = True
        return P.Ack()

    def _on_recentepisodes(self, msg: P.RecentEpisodes, now: float) -> P.Msg:
        rows = [r for seq, r in self.recent_rows if seq > msg.since]
        return P.RecentEpisodesReply(cursor=self.rows_seen, table_ipc=table_to_ipc(metas_to_table(rows)))

    def _on_envattach(self, msg: P.EnvAttach, now: float) -> P.Msg:
        try:
            entry = self.envs.attach(msg.spec, msg.name, msg.weight, msg.params)
        except ConfigError as exc:
            return P.ErrorReply(message=str(exc))
        self.ledger.envs = self.envs.usable_specs()
        log.info("attached environment %s (%s, weight %g)", entry.spec.display_name, msg.spec, msg.weight)
        return self._on_envlist(P.EnvList(), now)

    def _on_envdetach(self, msg: P.EnvDetach, now: float) -> P.Msg:
        try:
            self.envs.detach(msg.name)
        except ConfigError as exc:
            return P.ErrorReply(message=str(exc))
        self.ledger.envs = self.envs.usable_specs()
        log.info("detached environment %s: no new prompts; episodes in flight finish", msg.name)
        return self._on_envlist(P.EnvList(), now)

    def _on_envlist(self, msg: P.EnvList, now: float) -> P.Msg:
        return P.EnvListReply(envs_json=json.dumps(self._describe_envs()))

    def _describe_envs(self) -> list[dict[str, Any]]:
        loaded = {w.worker_id: w.envs_version for w in self.workers.values() if w.alive and w.role == P.Role.ROLLOUT}
        return self.envs.describe(loaded, self.env_episodes)

    def _on_statusrequest(self, msg: P.StatusRequest, now: float) -> P.Msg:
        return P.StatusReply(status_json=json.dumps(self.status(now)))

    def _queue_free(self, frees: dict[str, list[str]]) -> None:
        for address, ids in frees.items():
            self.pending_free.setdefault(address, []).extend(ids)

    # -- persistence --------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        state = SupervisorState(ledger=self.ledger.snapshot(), envs=list(self.envs.entries.values()),
                                envs_version=self.envs.version, env_episodes=self.env_episodes, policy_version=self.policy_version,
                                weights_address=self.weights_address, finished=self.finished,
                                workers=list(self.workers.values()), next_id=self._ids,
                                trainer_metrics=self.trainer_metrics)
        return msgspec.msgpack.encode(state)

    def restore(self, data: bytes, now: float) -> None:
        """Continue from a snapshot; known workers get a fresh lease to reconnect in."""
        state = msgspec.msgpack.decode(data, type=SupervisorState)
        self.ledger.restore(state.ledger)
        self.envs.entries = {e.spec.display_name: e for e in state.envs}
        self.envs.version, self.env_episodes = state.envs_version, dict(state.env_episodes)
        self.ledger.envs = self.envs.usable_specs()
        self.policy_version, self.weights_address = state.policy_version, state.weights_address
        self._ids, self.trainer_metrics = state.next_id, state.trainer_metrics
        # A finished run resumed with more steps (`up --resume --steps M`) goes on training.
        self.finished = state.finished and not (self.cfg.steps == 0 or state.policy_version < self.cfg.steps)
        for w in state.workers:
            w.last_seen = now
            self.workers[w.worker_id] = w

    # -- liveness -----------------------------------------------------------------------------

    def check_leases(self, now: float) -> None:
        lease = self.cfg.supervisor.lease_s
        for w in self.workers.values():
            if w.alive and w.role != P.Role.CLIENT and now - w.last_seen > lease:
                self._declare_dead(w, f"missed its lease of {lease:.1f}s")

    def forget_workers(self) -> None:
        """Every worker of a restored state is gone (a relaunched run): declare them dead now."""
        for w in self.workers.values():
            if w.alive and w.role != P.Role.CLIENT:
                self._declare_dead(w, "belongs to the earlier run")

    def _declare_dead(self, w: Worker, why: str) -> None:
        w.alive = False
        result = self.ledger.worker_lost(w.worker_id, w.shard_address)
        self.pending_free.pop(w.shard_address, None)
        log.warning("worker %s (pid %d) %s: declared dead; %d samples lost, %d prompts re-issued", w.worker_id, w.pid,
                    why, result["samples_lost"], result["prompts_reissued"])

    # -- status -------------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        c = self.ledger.counters
        rewards = [r for r, _, _, _ in self.recent]
        outcomes = [o for _, o, _, _ in self.recent]
        lengths = [n for _, _, n, _ in self.recent]
        wall = max(time.time() - self.started, 1e-9)
        pct = {f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)} if lengths else {}
        if lengths:
            pct["max"] = float(max(lengths))
        per_env: dict[str, dict[str, float]] = {}
        for r, _, n, env in self.recent:
            e = per_env.setdefault(env, {"episodes": 0, "reward_sum": 0.0, "tokens_sum": 0})
            e["episodes"] += 1
            e["reward_sum"] += r
            e["tokens_sum"] += n
        held: dict[str, int] = {}
        for g in self.ledger.groups.values():
            if g.state == PromptState.INFLIGHT:
                held[g.worker_id] = held.get(g.worker_id, 0) + 1
        return {
            "address": self.address,
            "metrics_address": self.metrics_address,
            "policy_version": self.policy_version,
            "finished": self.finished,
            "wall_seconds": wall,
            **dataclasses.asdict(c),
            "samples_in_store": self.ledger.samples_waiting(),
            "samples_claimed": self.ledger.samples_claimed(),
            "samples_uncheckpointed": self.ledger.samples_uncheckpointed(),
            "mean_reward_last": float(np.mean(rewards)) if rewards else None,
            "win_rate_last": outcomes.count("win") / len(outcomes) if outcomes else None,
            "draw_rate_last": outcomes.count("draw") / len(outcomes) if outcomes else None,
            "tokens_per_second": c.tokens_produced / wall,
            "context_length": pct,
            "plans": self.planner.status(),
            "envs": {e["name"]: {**e, **({"episodes_window": per_env[e["name"]]["episodes"],
                                          "mean_reward": per_env[e["name"]]["reward_sum"] / per_env[e["name"]]["episodes"],
                                          "mean_context_tokens": per_env[e["name"]]["tokens_sum"] / per_env[e["name"]]["episodes"]}
                                         if e["name"] in per_env else {})}
                     for e in self._describe_envs()},
            "trainer": self.trainer_metrics,
            "workers": [{"id": w.worker_id, "role": w.role.value, "alive": w.alive, "pid": w.pid, "host": w.host,
                         "rank": w.rank, "last_seen_s": round(now - w.last_seen, 2), "stats": w.stats,
                         "groups_held": held.get(w.worker_id, 0),
                         "shard_address": w.shard_address, "metrics_address": w.metrics_address}
                        for w in self.workers.values() if w.role != P.Role.CLIENT],
        }

    def export_metrics(self, now: float) -> None:
        c = self.ledger.counters
        for kind in ("samples_produced", "samples_consumed", "samples_lost", "samples_stale", "prompts_reissued",
                     "duplicates_detected"):
            M.SUP_SAMPLES.labels(kind).set(getattr(c, kind))
        M.SUP_SAMPLES.labels("in_store").set(self.ledger.samples_waiting())
        for role in (P.Role.ROLLOUT, P.Role.TRAINER):
            ws = [w for w in self.workers.values() if w.role == role]
            M.SUP_WORKERS.labels(role.value, "alive").set(sum(w.alive for w in ws))
            M.SUP_WORKERS.labels(role.value, "dead").set(sum(not w.alive for w in ws))
        if self.recent:
            M.SUP_REWARD.set(float(np.mean([r for r, _, _, _ in self.recent])))
            lengths = [n for _, _, n, _ in self.recent]
            for q in (50, 90, 99):
                M.SUP_CONTEXT.labels(f"p{q}").set(float(np.percentile(lengths, q)))
            M.SUP_CONTEXT.labels("max").set(max(lengths))
            by_env: dict[str, list[float]] = {}
            for r, _, _, env in self.recent:
                by_env.setdefault(env, []).append(r)
            for env, rs in by_env.items():
                M.SUP_ENV_REWARD.labels(env).set(float(np.mean(rs)))


MUTATING = (P.Register, P.RequestPrompts, P.PutMeta, P.Claim, P.Release, P.PublishVersion, P.Finished, P.EnvAttach,
            P.EnvDetach)


def serve(cfg: RunConfig, bind: str, *, ready_file: str | None = None, secret: bytes | None = None,
          state_dir: str | None = None, forget_workers: bool = False) -> None:
    """Run the supervisor until SIGTERM/SIGINT. `bind` is host:port (port 0 = pick a free one)."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
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
    state_path = Path(state_dir or cfg.run_dir) / "supervisor.state"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    journal_path = state_path.parent / "trained.jsonl"
    if state_path.exists():
        try:
            sup.restore(state_path.read_bytes(), time.monotonic())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"cannot resume from {state_path} ({exc}); it was written by another version of "
                              "earl_stream or is damaged: move it away to start a fresh run") from None
        log.info("restored state from %s: policy version %d, %d prompts issued, %d samples waiting", state_path,
                 sup.policy_version, sup.ledger.next_ordinal, sup.ledger.samples_waiting())
        if forget_workers:
            sup.forget_workers()
    M.register_supervisor_metrics()
    metrics_address = M.start_metrics_server(host or "127.0.0.1")
    sup.metrics_address = metrics_address
    log.info("supervisor listening on %s (metrics on http://%s/metrics)", address, metrics_address)
    if ready_file:
        Path(ready_file).write_text(json.dumps({"address": address, "metrics_address": metrics_address}))
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    last_tick = 0.0
    saved = b""
    while not stopping:
        if sock.poll(100):
            frames = sock.recv_multipart()
            now = time.monotonic()
            payload = verify(secret, frames[-1])
            if payload is None:
                log.warning("refused a control message without the cluster secret (peer %s)", frames[0].hex()[:16])
                sock.send_multipart([frames[0], b"", P.encode(P.ErrorReply(message="authentication failed"))])
                continue
            try:
                msg = P.decode(payload)
                reply = sup.handle(msg, now)
                if isinstance(msg, MUTATING):  # write-ahead: persisted before the peer hears back
                    _write_journal(sup, journal_path)
                    saved = _persist(sup, state_path, saved)
            except ProtocolError as exc:
                log.warning("bad control message from peer %s: %s", frames[0].hex()[:16], exc)
                reply = P.ErrorReply(message=str(exc))
            sock.send_multipart([frames[0], b"", sign(secret, P.encode(reply))])
        now = time.monotonic()
        if now - last_tick > 0.25:
            sup.check_leases(now)
            sup.export_metrics(now)
            saved = _persist(sup, state_path, saved)
            last_tick = now
    _persist(sup, state_path, saved)
    sock.close(0)
    log.info("supervisor stopped")


def _write_journal(sup: Supervisor, path: Path) -> None:
    """Append each released step's prompt ordinals to `trained.jsonl` in the state directory.

    One JSON line per step: {"step", "trained": [ordinals], "lost": [ordinals]}. A step released,
    journaled and then lost from a crashed supervisor's snapshot is released again, so a step may
    appear twice, with the same ordinals.
    """
    if not sup.ledger.journal:
        return
    with path.open("a") as f:
        for entry in sup.ledger.journal:
            f.write(json.dumps(entry) + "\n")
    sup.ledger.journal.clear()


def _persist(sup: Supervisor, path: Path, previous: bytes) -> bytes:
    """Write the state atomically when it changed; returns what is on disk now."""
    data = sup.snapshot()
    if data != previous:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return data
