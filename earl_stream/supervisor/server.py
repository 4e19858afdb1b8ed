"""The supervisor process: a ZMQ ROUTER that answers control-plane messages, keeps membership by
heartbeats and leases, and keeps the ledger (prompts, layout index, claims) and run statistics.

It never touches tensor bytes: producers keep their shards, consumers pull them directly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
from collections import deque
from typing import Any

import msgspec

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.config import RunConfig, config_to_json
from earl_stream.errors import ConfigError
from earl_stream.store.schema import SampleMeta, metas_to_table, table_from_ipc, table_to_ipc
from earl_stream.store.weight_route import WeightRoute, weight_route
from earl_stream.supervisor import status_report
from earl_stream.supervisor.envs import EnvEntry, EnvRegistry
from earl_stream.supervisor.episode_window import Finished
from earl_stream.supervisor.eval_rounds import EvalRounds
from earl_stream.supervisor.ledger import Ledger, outcome_of
from earl_stream.supervisor.metrics_log import MetricsLog, replanned_at, staleness_histogram
from earl_stream.supervisor.planning import Planner, PlannerState
from earl_stream.supervisor.pools import Member, decide, order_of
from earl_stream.supervisor.recovery import recover

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
    ray_node_id: str = ""  # the Ray node it runs on (the ray launcher)
    openai_url: str = ""  # a rollout worker's OpenAI-compatible endpoint
    draining: bool = False  # scaled down: no new prompts, leaves once its samples are released
    drained: bool = False  # left after draining (not alive, nothing lost)


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
    plans: PlannerState | None = None  # None in snapshots of earlier versions
    rollout_replicas: int = -1  # the desired rollout pool size set by `scale` (-1: never set)
    wal_seq: int = 0  # the last write-ahead log record this snapshot holds (supervisor/wal.py)
    checkpoint_version: int = -1  # the step of the trainer's latest checkpoint (-1: none, or an older snapshot)
    run_id: str = ""  # random, made when the run's state was first written ("" in older snapshots)
    evals: bytes = b""  # evaluation rounds (supervisor/eval_rounds.py; "" in older snapshots)
    held_record: bytes = b""  # JSON [step, record]: the last step's metrics.jsonl record, held for its eval round


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
                             max_staleness=t.max_staleness, dynamic_sampling=cfg.algo.dynamic_sampling)
        self.workers: dict[str, Worker] = {}
        self.evals = EvalRounds(cfg)  # evaluation during training: never in the ledger
        self.policy_version = 0
        self.weights_address = ""
        self.trainer_metrics: dict[str, float] = {}
        self.finished = False
        self.started = time.time()
        self.recent: deque[Finished] = deque(maxlen=cfg.supervisor.stats_window)
        self.recent_rows: deque[tuple[int, SampleMeta]] = deque(maxlen=cfg.supervisor.stats_window)
        self.rows_seen = 0
        self.pending_free: dict[str, list[str]] = {}  # producer address -> sample ids to drop
        self.lost_before_resume = -1  # samples_lost when `up --resume` forgot the earlier run's workers (-1: not)
        self.run_id = secrets.token_hex(8)  # names this run's ledger (kept across restarts and `up --resume`)
        self.checkpoint_version = -1  # the latest checkpointed step: rollout workers persist their samples then
        self.rollout_replicas = -1  # desired rollout workers (-1: not set; every worker that joins takes prompts)
        self.expired: list[tuple[str, str]] = []  # (worker, why) declared dead by check_leases, for the log
        self._membership = 0  # bumped when a worker joins, rejoins or leaves (the cache key of _weight_route)
        self._route_pool: tuple[int, list[tuple[str, str]], int] | None = None
        self._ids = 0
        self.metrics_log: MetricsLog | None = None  # RUN_DIR/metrics.jsonl, one line per step (set by serve())
        self.revoked_workers: set[str] = set()  # worker ids `keys revoke` refused (revocation.py; set by serve())

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
        if wid in self.workers and self.workers[wid].drained:
            # a worker that drained registering again (a late start-up call): it stays gone, and its next
            # heartbeat tells it to leave
            log.info("%s registered again after it drained: it leaves at its next heartbeat", wid)
            return P.Registered(worker_id=wid, config_json=self.config_json, policy_version=self.policy_version,
                                weights_address=self.weights_address, run_id=self.run_id)
        draining = wid in self.workers and self.workers[wid].draining  # a reconnect keeps draining
        self._membership += 1
        self.workers[wid] = Worker(wid, msg.role, msg.host, msg.pid, msg.rank, msg.shard_address,
                                   msg.metrics_address, now, ray_node_id=msg.ray_node_id, draining=draining,
                                   openai_url=msg.openai_url)
        if msg.role != P.Role.CLIENT:
            log.info("registered %s (pid %d on %s, shards at %s)", wid, msg.pid, msg.host, msg.shard_address or "-")
        return P.Registered(worker_id=wid, config_json=self.config_json, policy_version=self.policy_version,
                            weights_address=self.weights_address, run_id=self.run_id)

    def _on_heartbeat(self, msg: P.Heartbeat, now: float) -> P.Msg:
        worker = self.workers.get(msg.worker_id)
        if worker is not None and worker.drained:  # a retried heartbeat of a worker that left: leave again
            return P.HeartbeatReply(policy_version=self.policy_version, stop=True, drained=True)
        if worker is None or not worker.alive:
            return P.HeartbeatReply(known=False, policy_version=self.policy_version)
        worker.stats = dict(msg.stats)
        worker.envs_version = msg.envs_version
        if worker.role == P.Role.ROLLOUT and "oom_sheds" in msg.stats:  # before the reply, as the memory below
            self.planner.on_rollout_sheds(worker.worker_id, int(msg.stats["oom_sheds"]), step=self.policy_version,
                                          attempted_bytes=msg.oom_attempted_bytes, in_use_bytes=msg.oom_in_use_bytes)
        if worker.role == P.Role.ROLLOUT and "memory_bytes" in msg.stats:
            self._rollout_memory()  # before the reply: the plan it carries is sized for this worker's memory
        if msg.env_errors and self.envs.report(worker.worker_id, msg.env_errors):
            log.warning("%s cannot load %s: those environments get no new prompts", worker.worker_id, msg.env_errors)
            self.ledger.envs = self.envs.usable_specs()
        published = int(msg.stats.get("published_version", -1))
        if worker.role == P.Role.TRAINER and worker.rank == 0 and published > self.policy_version:
            # the trainer is authoritative: after a supervisor restart from a slightly older snapshot,
            # its heartbeat brings the policy version back in line. Only rank 0's: its node holds the
            # manifest that names the other ranks' pieces (a rank > 0 serves only its own pieces, and
            # may be a version ahead of or behind rank 0 for a moment around a publish). Forward only: a
            # heartbeat is built before it is sent, on its own socket, so one built just before a
            # PublishVersion can arrive after it with the previous version; taking it rolled the rollout
            # workers back to the older weights mid-episode. A real rollback (a trainer resumed from an older
            # checkpoint) comes by PublishVersion, which is authoritative.
            log.info("policy version %d (from %s's heartbeat; was %d)", published, worker.worker_id, self.policy_version)
            self.policy_version, self.weights_address = published, worker.shard_address
        if msg.leaving and worker.role == P.Role.ROLLOUT and not worker.draining:
            # its host stops it (a pod scaled down, a preempted node): it drains, then leaves
            worker.draining = True
            log.info("%s is leaving (its host stopped it): draining: no new prompts; it leaves once its samples are "
                     "trained and released", worker.worker_id)
        free = self.pending_free.pop(worker.shard_address, [])
        envs_json = self.envs.specs_json() if msg.envs_version < self.envs.version else ""
        drained = worker.draining and self.ledger.held_by(worker.worker_id, worker.shard_address) == 0
        if drained:  # its last frees go with this reply; it exits, nothing of it is needed any more
            worker.alive, worker.draining, worker.drained = False, False, True
            self._membership += 1
            self.evals.worker_lost(worker.worker_id)  # evaluation episodes it was playing: to another worker
            log.info("%s drained: every sample it produced is trained and released; it leaves", worker.worker_id)
        route = self._weight_route(worker) if worker.role == P.Role.ROLLOUT and not drained else WeightRoute()
        return P.HeartbeatReply(policy_version=self.policy_version, weights_address=self.weights_address,
                                stop=self.finished or drained, free_sample_ids=free, envs_version=self.envs.version,
                                envs_json=envs_json, plan=self.planner.rollout_wire, drain=worker.draining,
                                drained=drained, weights_relay=route.relay, weights_via=route.via,
                                checkpoint_version=self.checkpoint_version)

    def _rollout_memory(self) -> None:
        """The rollout plan follows the smallest engine memory the live rollout workers report."""
        reported = {w.worker_id: int(w.stats["memory_bytes"]) for w in self.workers.values()
                    if w.role == P.Role.ROLLOUT and w.alive and w.stats.get("memory_bytes", 0) > 0}
        self.planner.on_rollout_memory(reported, step=self.policy_version)

    def _weight_route(self, worker: Worker) -> WeightRoute:
        """How `worker` pulls new weights (store.weight_sync; store/weight_route.py). The pool it is routed
        in (live rollout workers in join order, trainer hosts) is rebuilt only when the membership changed."""
        if self.cfg.store.weight_sync == "direct":
            return WeightRoute()
        if self._route_pool is None or self._route_pool[0] != self._membership:
            pool = [(w.host, w.shard_address) for w in self.workers.values()
                    if w.role == P.Role.ROLLOUT and w.alive and w.shard_address]
            trainer_hosts = len({w.host for w in self.workers.values() if w.role == P.Role.TRAINER and w.alive})
            self._route_pool = (self._membership, pool, max(1, trainer_hosts))
        _, pool, trainer_hosts = self._route_pool
        return weight_route(self.cfg.store.weight_sync, pool, worker.shard_address, trainer_hosts=trainer_hosts)

    def _on_requestprompts(self, msg: P.RequestPrompts, now: float) -> P.Msg:
        if self.finished or msg.worker_id not in self.workers or self.workers[msg.worker_id].draining:
            return P.Prompts(prompts=[])
        over = self.evals.training_over(self.policy_version)  # only the final evaluation round is left to play
        if self.evals.enabled and msg.request_id not in self.ledger.requests.get(msg.worker_id, {}):
            self.evals.on_version(self.policy_version)
            if tasks := self.evals.issue(msg.worker_id, msg.request_id, every_slot=over):  # between training groups
                return P.Prompts(eval_tasks=tasks)
        if over:
            return P.Prompts(prompts=[])
        return P.Prompts(prompts=self.ledger.issue(msg.worker_id, msg.max_groups, msg.request_id, now))

    def _on_evalpending(self, msg: P.EvalPending, now: float) -> P.Msg:
        self.evals.on_version(self.policy_version)  # the final round is decided here if no worker asked yet
        return self.evals.pending()

    def _on_puteval(self, msg: P.PutEval, now: float) -> P.Msg:
        self.evals.put(msg.worker_id, msg.results)
        if not self.evals.state.rounds and self.metrics_log is not None:  # the held last step's record: now
            self.metrics_log.release(self.evals.status())
        return P.Ack()

    def _on_putmeta(self, msg: P.PutMeta, now: float) -> P.Msg:
        self.ledger.add_rows(msg.worker_id, msg.rows)
        self.ledger.fail_groups(msg.failed_groups, now)
        self.planner.add(msg.rows)
        for row in msg.rows:
            self.rows_seen += 1
            self.recent_rows.append((self.rows_seen, row))
            if row.segment == 0:  # the episode window counts an episode once, however many samples it became
                self.env_episodes[row.env] = self.env_episodes.get(row.env, 0) + 1
                self.recent.append(Finished(row.reward, outcome_of(row), row.total_tokens, row.env, row.group_id))
        return P.Ack()

    def _on_recoversamples(self, msg: P.RecoverSamples, now: float) -> P.Msg:
        accepted, refused = recover(self.ledger, msg.rows)
        c = self.ledger.counters
        log.info("resume: %d samples recovered from %s, %d refused there (no longer wanted); so far %d recovered, "
                 "%d re-played (lost%s, their prompts re-issued)", len(accepted), msg.source or "-", len(refused),
                 c.samples_recovered, self.replayed(), " since the resume" if self.lost_before_resume >= 0 else "")
        return P.Recovered(accepted=accepted, refused=refused)

    def _on_claim(self, msg: P.Claim, now: float) -> P.Msg:
        first = msg.step not in self.ledger.claims
        ipc, stale = self.ledger.claim(msg.step, msg.num_groups, msg.min_policy_version)
        self._queue_free(stale)
        if ipc is not None and first:
            self.planner.on_step(msg.step, ipc)  # a step boundary: the pools may adopt a new plan here
        return P.Claimed(step=msg.step, ready=ipc is not None, table_ipc=ipc or b"",
                         plan=self.planner.trainer_wire if ipc is not None else None,
                         waiting="" if ipc is not None else self._waiting())

    def _waiting(self) -> str:
        """Why a claim may be waiting, from what the supervisor counts (empty: nothing unusual)."""
        too_long = self.ledger.counters.samples_too_long
        if not too_long:
            return ""
        bound = self.planner.max_trainable_tokens
        return (f"{too_long} episode(s) so far were refused or stopped as longer than the pools can run"
                f"{f' ({bound} tokens)' if bound else ''}: status samples_too_long; "
                f"the supervisor's log says which plans were refused and why")

    def _on_planadopted(self, msg: P.PlanAdopted, now: float) -> P.Msg:
        self.planner.on_adopted(msg.version, msg.step)
        return P.Ack()

    def _on_traineroom(self, msg: P.TrainerOom, now: float) -> P.Msg:
        """The trainer abandoned a step on an allocation failure: correct the memory model, re-plan, and let
        it claim the same step (the same rows) again under the new plan. Rows no plan holds any more are
        refused for good (`samples_too_long`) and the rest retry; with every row refused the step is claimed
        afresh. The message is write-ahead logged, so a restarted supervisor replays the same refusal."""
        claim = self.ledger.claims.get(msg.step)
        lengths = table_from_ipc(claim[0]).column("total_tokens").to_pylist() if claim else []
        answer = self.planner.on_oom(msg, lengths)
        log.warning("trainer step %d failed to allocate under plan v%d (%d rows, %d tokens, longest %d; %d bytes "
                    "asked): %s", msg.step, msg.plan_version, msg.rows, msg.tokens, msg.longest, msg.attempted_bytes,
                    answer.message)
        if answer.refuse_longer_than is not None:
            refused, to_free = self.ledger.refuse_longer(msg.step, answer.refuse_longer_than)
            self._queue_free(to_free)
            if refused:
                log.warning("step %d: refused as too long for any plan: %s", msg.step,
                            ", ".join(f"{r.sample_id} ({r.total_tokens} tokens)" for r in refused))
        return P.OomReplanned(plan=answer.plan, message=answer.message)

    def _on_release(self, msg: P.Release, now: float) -> P.Msg:
        if msg.checkpointed:
            self._queue_free(self.ledger.release(msg.step, msg.lost_sample_ids))
            self.checkpoint_version = max(self.checkpoint_version, msg.step + 1)
        else:
            self._queue_free(self.ledger.trained(msg.step, msg.lost_sample_ids))
        return P.Ack()

    def _on_publishversion(self, msg: P.PublishVersion, now: float) -> P.Msg:
        self.policy_version = msg.version  # the trainer is authoritative (a resume may roll back)
        self.weights_address = msg.weights_address
        self.trainer_metrics = dict(msg.metrics)
        self.planner.on_trained(msg.version - 1, self.trainer_metrics)  # refits the cost model now and then
        M.SUP_POLICY_VERSION.set(self.policy_version)
        steps = self.metrics_log
        # a publish without a loss (the trainer's first, or after its resume) ends no step
        if steps is not None and "loss" in msg.metrics and msg.version > steps.last_step:
            rec = steps.record(self.status(now), self.trainer_metrics,
                               replanned_at(self.planner.trainer_history, msg.version - 1),
                               staleness_histogram(self.ledger, msg.version - 1))
            if self.evals.training_over(msg.version):  # the last step: its record waits for the final round
                steps.hold(msg.version, rec)
            else:
                steps.append(msg.version, rec)
        return P.Ack()

    def _on_finished(self, msg: P.Finished, now: float) -> P.Msg:
        if self.metrics_log is not None:  # a held record goes out with the rounds that finished
            self.metrics_log.release(self.evals.status())
        log.info("run finished (%s): telling workers to stop", msg.reason)
        self.finished = True
        return P.Ack()

    def _on_recentepisodes(self, msg: P.RecentEpisodes, now: float) -> P.Msg:
        rows = [r for seq, r in self.recent_rows if seq > msg.since]
        return P.RecentEpisodesReply(cursor=self.rows_seen, table_ipc=table_to_ipc(metas_to_table(rows)))

    def _on_envattach(self, msg: P.EnvAttach, now: float) -> P.Msg:
        try:
            entry = self.envs.attach(msg.spec, msg.name, msg.weight, msg.params, msg.group_seed)
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
        return P.EnvListReply(envs_json=json.dumps(self.describe_envs()))

    def describe_envs(self) -> list[dict[str, Any]]:
        loaded = {w.worker_id: w.envs_version for w in self.workers.values() if w.alive and w.role == P.Role.ROLLOUT}
        return self.envs.describe(loaded, self.env_episodes)

    def _on_scale(self, msg: P.Scale, now: float) -> P.Msg:
        if msg.role != P.Role.ROLLOUT:
            return P.ErrorReply(message=f"only the rollout pool scales live, not {msg.role.value} (the trainer pool "
                                        "changes its layout through plans, its size at a restart)")
        if msg.replicas < 0:
            return P.ErrorReply(message=f"replicas={msg.replicas}: a pool size is >= 0")
        pool = [w for w in self.workers.values() if w.role == P.Role.ROLLOUT and w.alive]
        decision = decide([Member(w.worker_id, w.draining, self.ledger.held_by(w.worker_id, w.shard_address),
                                  order_of(w.worker_id)) for w in pool], msg.replicas)
        for wid in decision.drain:
            self.workers[wid].draining = True
        for wid in decision.undrain:
            self.workers[wid].draining = False
        self.rollout_replicas = msg.replicas
        log.info("rollout pool scaled to %d: draining %s, drain cancelled for %s, %d to start", msg.replicas,
                 decision.drain or "none", decision.undrain or "none", decision.to_start)
        return P.ScaleReply(replicas=msg.replicas, active=sum(not w.draining for w in pool),
                            draining=[w.worker_id for w in pool if w.draining], undrained=decision.undrain,
                            to_start=decision.to_start)

    def _on_statusrequest(self, msg: P.StatusRequest, now: float) -> P.Msg:
        return P.StatusReply(status_json=json.dumps(self.status(now)))

    def _queue_free(self, frees: dict[str, list[str]]) -> None:
        for address, ids in frees.items():
            self.pending_free.setdefault(address, []).extend(ids)

    # -- persistence --------------------------------------------------------------------------

    def snapshot(self, wal_seq: int = 0) -> bytes:
        state = SupervisorState(ledger=self.ledger.snapshot(), envs=list(self.envs.entries.values()),
                                envs_version=self.envs.version, env_episodes=self.env_episodes, policy_version=self.policy_version,
                                weights_address=self.weights_address, finished=self.finished,
                                workers=list(self.workers.values()), next_id=self._ids,
                                trainer_metrics=self.trainer_metrics, plans=self.planner.snapshot(),
                                rollout_replicas=self.rollout_replicas, wal_seq=wal_seq,
                                checkpoint_version=self.checkpoint_version, run_id=self.run_id,
                                evals=self.evals.snapshot(),
                                held_record=self.metrics_log.held_json() if self.metrics_log is not None else b"")
        return msgspec.msgpack.encode(state)

    def restore(self, data: bytes, now: float) -> int:
        """Continue from a snapshot; known workers get a fresh lease to reconnect in. Returns the
        sequence number of the last write-ahead log record the snapshot holds."""
        state = msgspec.msgpack.decode(data, type=SupervisorState)
        self.ledger.restore(state.ledger)
        self.envs.entries = {e.spec.display_name: e for e in state.envs}
        self.envs.version, self.env_episodes = state.envs_version, dict(state.env_episodes)
        self.ledger.envs = self.envs.usable_specs()
        self.policy_version, self.weights_address = state.policy_version, state.weights_address
        self._ids, self.trainer_metrics = state.next_id, state.trainer_metrics
        self.rollout_replicas = state.rollout_replicas
        self.checkpoint_version = state.checkpoint_version
        self.run_id = state.run_id or self.run_id
        self.evals.restore(state.evals)
        if self.metrics_log is not None:
            self.metrics_log.restore_held(state.held_record)
        if state.plans is not None:
            self.planner.restore(state.plans)
        # A finished run resumed with more steps (`up --resume --steps M`) goes on training.
        self.finished = state.finished and not (self.cfg.steps == 0 or state.policy_version < self.cfg.steps)
        for w in state.workers:
            w.last_seen = now
            self.workers[w.worker_id] = w
        return state.wal_seq

    # -- liveness -----------------------------------------------------------------------------

    def check_leases(self, now: float) -> None:
        lease = self.cfg.supervisor.lease_s
        for w in self.workers.values():
            if w.alive and w.role != P.Role.CLIENT and now - w.last_seen > lease:
                # once the run has finished every worker is told to stop: one that stops beating is leaving (its
                # exit can take longer than a lease on a loaded host), not dying
                why = "stopped after the run finished" if self.finished else f"missed its lease of {lease:.1f}s"
                self.declare_dead(w, why)
                self.expired.append((w.worker_id, why))

    def replayed(self) -> int:
        """Samples lost (their prompts played again) since `up --resume`, else in the whole run."""
        return self.ledger.counters.samples_lost - max(0, self.lost_before_resume)

    def forget_workers(self) -> None:
        """Every worker of a restored state is gone (a relaunched run): declare them dead now."""
        self.lost_before_resume = self.ledger.counters.samples_lost
        for w in self.workers.values():
            if w.alive and w.role != P.Role.CLIENT:
                self.declare_dead(w, "belongs to the earlier run")
            elif w.role != P.Role.CLIENT and not self.finished:  # left a finished run: what it held is gone now
                self.ledger.worker_lost(w.worker_id, w.shard_address)

    def declare_dead(self, w: Worker, why: str) -> None:
        """`w` is gone. Before the run finished its prompts are played again and the samples only it held are lost;
        after, nothing is played again and the samples it holds stay counted in the store (a worker persists them
        as it stops), so a run's summary does not depend on how long its workers took to leave."""
        w.alive = False
        self._membership += 1
        result = self.ledger.worker_lost(w.worker_id, w.shard_address) if not self.finished else \
            {"samples_lost": 0, "prompts_reissued": 0}
        self.evals.worker_lost(w.worker_id)
        self.pending_free.pop(w.shard_address, None)
        log.log(logging.INFO if self.finished else logging.WARNING,
                "worker %s (pid %d) %s: %s; %d samples lost, %d prompts re-issued%s", w.worker_id, w.pid,
                why, "gone" if self.finished else "declared dead", result["samples_lost"], result["prompts_reissued"],
                " (a worker restarted on its host may still recover the samples it persisted)"
                if result["samples_lost"] and self.cfg.store.durable_experience else "")

    # -- status -------------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        """The run's status (`earl-stream status`, the dashboards' JSON): `status_report.status`."""
        return status_report.status(self, now)

    def export_metrics(self, now: float) -> None:
        status_report.export_metrics(self)
