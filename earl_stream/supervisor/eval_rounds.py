"""Evaluation during training, the supervisor's side: when the policy version reaches a multiple of
`eval.every` (and at version 0) a round of evaluation episodes is due: every (held-out item, sample) of
every eval environment (`earl_stream.evaluation.heldout`) becomes one `EvalTask`. An environment with no
held-out set of its own (a game) is played on evaluation seeds, which the ledger never issues for training
(`earl_stream.env.seeds`); its points say so (`items`) and carry its win, draw and loss rates.

Rollout workers ask for work with `RequestPrompts` as always; while a round has tasks left, a request is
answered with a batch of them (trainer.group_size episodes, like a group) instead of a training prompt,
but never on more than `eval.share` of a worker's slots at once, so the other slots keep playing
training groups and evaluation overlaps training instead of pausing it. Results come back in `PutEval`.
Nothing of it enters the ledger: evaluation episodes get no prompt ordinal, are never put in a store,
never claimed, and never counted as produced or trained samples.

A round whose tasks are all back gives, per environment, success, pass@k (k = 1..samples) and mean reward
(`evaluation.passk`) with the policy versions that played it (a worker plays a task with weights at least
as new as the round's version); they are exported as `earl_eval_*` gauges and in the status (`eval`).
A new round is skipped while an earlier one is unfinished (evaluation slower than `every` versions of
training would otherwise pile up), except the final version's (`steps`, where eval.final_timeout_s > 0), which is
always played, and by every slot of a worker: training is over, the trainer waits for it (`EvalPending`), and the
run's curve ends at the policy it saved. Tasks held by a worker declared dead go back to the queue; a repeated
request id gets the tasks it was first given (a lost reply). Pure bookkeeping, no I/O, persisted with the
supervisor's state.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import msgspec

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.config import RunConfig
from earl_stream.evaluation.heldout import HeldOutSet, HeldOutUnavailable, held_out_set
from earl_stream.evaluation.passk import EpisodeOutcome, summarize

log = logging.getLogger(__name__)

HISTORY_KEPT = 1000  # points per environment in the status
# what each point of the status's history keeps (a game's rates are None elsewhere)
HISTORY_KEYS = ("version", "value", "pass_at_k", "mean_reward", "win_rate", "draw_rate", "loss_rate")


class Round(msgspec.Struct):
    version: int
    tasks: dict[str, P.EvalTask]
    pending: list[str]  # not handed out, oldest first
    assigned: dict[str, str] = {}  # task id -> worker
    results: dict[str, P.EvalResult] = {}
    finished: list[str] = []  # environments whose point is recorded


class EvalState(msgspec.Struct):
    rounds: list[Round] = []  # unfinished rounds, oldest first
    considered: int = -1  # the newest policy version a round was decided for
    skipped: list[int] = []  # versions whose round was skipped (an earlier one was unfinished)
    history: dict[str, list[dict[str, Any]]] = {}  # env -> points, oldest first
    requests: dict[str, dict[str, list[str]]] = {}  # worker -> request id -> task ids


class EvalRounds:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg.eval
        self.batch = cfg.trainer.group_size
        self.cap = max(1, math.floor(cfg.eval.share * cfg.rollout.groups_in_flight))
        self.final_version = cfg.steps if cfg.eval.final_timeout_s > 0 else 0  # 0: no final round
        self.state = EvalState()
        self.sets: dict[str, HeldOutSet] = {}
        self.errors: dict[str, str] = {}
        if self.enabled:
            self._build_sets(cfg)

    @property
    def enabled(self) -> bool:
        return self.cfg.every > 0

    def _build_sets(self, cfg: RunConfig) -> None:
        envs = {e.display_name: e for e in cfg.envs}
        for name in self.cfg.envs or list(envs):
            spec = envs[name]  # config validation checked the names
            try:
                self.sets[name] = held_out_set(spec.spec, dict(spec.params), self.cfg.problems, name)
            except HeldOutUnavailable as exc:
                self.errors[name] = str(exc)
                log.error("evaluation of %s is off: %s", name, exc)
        log.info("evaluation every %d versions on %s: %d items x %d samples each (temperature %g)",
                 self.cfg.every, ", ".join(f"{n} ({h.describe()})" for n, h in sorted(self.sets.items())) or "nothing",
                 self.cfg.problems, self.cfg.samples, self.cfg.temperature)

    # -- rounds -------------------------------------------------------------------------------

    def on_version(self, version: int) -> None:
        """Decide the round of `version` (once per version): due at multiples of `every` and at the final one."""
        if not self.enabled or not self.sets or version <= self.state.considered:
            return
        self.state.considered = version
        final = version == self.final_version > 0
        if version % self.cfg.every and not final:
            return
        if self.state.rounds and not final:
            self.state.skipped.append(version)
            log.info("evaluation round of version %d skipped: the round of version %d is not finished", version,
                     self.state.rounds[0].version)
            return
        tasks: dict[str, P.EvalTask] = {}
        for name, held in self.sets.items():
            params = json.dumps(held.params, sort_keys=True)
            for item, seed in enumerate(held.seeds):
                for sample in range(self.cfg.samples):
                    tid = f"e{version}.{name}.{item}.{sample}"
                    tasks[tid] = P.EvalTask(task_id=tid, version=version, env=name, spec=held.spec, params_json=params,
                                            item=item, seed=seed, sample=sample, temperature=self.cfg.temperature,
                                            success_outcomes=list(held.success_outcomes))
        self.state.rounds.append(Round(version=version, tasks=tasks, pending=list(tasks)))
        log.info("evaluation round of version %d: %d episodes", version, len(tasks))

    def training_over(self, version: int) -> bool:
        """Whether `version` is the final one with a final round: the pool plays only evaluation from then on."""
        return self.enabled and bool(self.sets) and version >= self.final_version > 0

    def pending(self) -> P.EvalPendingReply:
        """The oldest unfinished round and how far it is (pending False: none)."""
        if not self.state.rounds:
            return P.EvalPendingReply()
        r = self.state.rounds[0]
        return P.EvalPendingReply(pending=True, version=r.version, done=len(r.results), total=len(r.tasks))

    def issue(self, worker_id: str, request_id: str, *, every_slot: bool = False) -> list[P.EvalTask]:
        """A batch of tasks for this request of `worker_id`, or [] (no round, or its eval slots are full;
        `every_slot`: no cap, training is over)."""
        seen = self.state.requests.setdefault(worker_id, {})
        if request_id and request_id in seen:
            return [t for r in self.state.rounds for tid in seen[request_id]
                    if (t := r.tasks.get(tid)) is not None and r.assigned.get(tid) == worker_id]
        busy = sum(1 for ids in seen.values() if any(self._open(tid, worker_id) for tid in ids))
        round_ = next((r for r in self.state.rounds if r.pending), None)
        if round_ is None or (busy >= self.cap and not every_slot):
            return []
        ids, round_.pending = round_.pending[:self.batch], round_.pending[self.batch:]
        for tid in ids:
            round_.assigned[tid] = worker_id
        seen[request_id or f"-{len(seen)}"] = ids
        while len(seen) > 64:
            del seen[next(iter(seen))]
        return [round_.tasks[tid] for tid in ids]

    def _open(self, tid: str, worker_id: str) -> bool:
        return any(r.assigned.get(tid) == worker_id and tid not in r.results for r in self.state.rounds)

    def put(self, worker_id: str, results: list[P.EvalResult]) -> None:
        """Record results (a repeat, or a task not held by `worker_id` any more, is ignored); finish rounds."""
        for res in results:
            r = next((r for r in self.state.rounds if res.task_id in r.tasks), None)
            if r is None or res.task_id in r.results or r.assigned.get(res.task_id) != worker_id:
                continue
            r.results[res.task_id] = res
        for r in list(self.state.rounds):
            self._finish_envs(r)
            if len(r.results) == len(r.tasks):
                self.state.rounds.remove(r)

    def _finish_envs(self, r: Round) -> None:
        for name in self.sets:
            tids = [t for t, task in r.tasks.items() if task.env == name]
            if name in r.finished or not tids or any(t not in r.results for t in tids):
                continue
            r.finished.append(name)
            s = summarize(EpisodeOutcome(r.tasks[t].item, r.tasks[t].sample, r.results[t].reward, r.results[t].success,
                                         r.results[t].outcome, r.results[t].tokens, r.results[t].policy_version)
                          for t in tids)
            point = {"version": r.version, "value": s.success, "items": self.sets[name].items, **s.to_dict()}
            history = self.state.history.setdefault(name, [])
            history.append(point)
            del history[:-HISTORY_KEPT]
            game = "" if s.win_rate is None else f", win {s.win_rate:.3f} draw {s.draw_rate:.3f} loss {s.loss_rate:.3f}"
            log.info("evaluation of %s at version %d (played by versions %s): success %.3f, %s, mean reward %.3f%s",
                     name, r.version, s.versions, s.success,
                     ", ".join(f"pass@{k} {v:.3f}" for k, v in s.pass_at_k.items()), s.mean_reward, game)

    def worker_lost(self, worker_id: str) -> None:
        """Tasks `worker_id` held and did not report go back to the front of their round's queue."""
        for r in self.state.rounds:
            lost = [t for t, w in r.assigned.items() if w == worker_id and t not in r.results]
            for t in lost:
                del r.assigned[t]
            r.pending = lost + r.pending
        self.state.requests.pop(worker_id, None)

    # -- reporting and persistence ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """env -> the latest point (version, value = success, pass_at_k, mean_reward, ...) with its history
        and the round in progress; an environment that cannot be evaluated -> {"error": why}."""
        out: dict[str, Any] = {name: {"error": why} for name, why in self.errors.items()}
        for name in self.sets:
            history = self.state.history.get(name, [])
            running = [r for r in self.state.rounds if name not in r.finished]
            progress = None if not running else {
                "version": running[0].version,
                "done": sum(1 for t in running[0].results if running[0].tasks[t].env == name),
                "total": sum(1 for t in running[0].tasks.values() if t.env == name)}
            out[name] = {**(history[-1] if history else {"version": None, "value": None}),
                         "history": [{k: p[k] for k in HISTORY_KEYS if k in p} for p in history],
                         "items": self.sets[name].items,
                         "in_progress": progress, "skipped_versions": list(self.state.skipped[-20:])}
        return out

    def export_metrics(self) -> None:
        for name, history in self.state.history.items():
            if not history:
                continue
            last = history[-1]
            M.EVAL_SUCCESS.labels(name).set(last["success"])
            M.EVAL_VERSION.labels(name).set(last["version"])
            M.EVAL_REWARD.labels(name).set(last["mean_reward"])
            for k, v in last["pass_at_k"].items():
                M.EVAL_PASS_AT_K.labels(name, str(k)).set(v)
            for outcome in ("win", "draw", "loss"):
                if last.get(f"{outcome}_rate") is not None:
                    M.EVAL_OUTCOME_RATE.labels(name, outcome).set(last[f"{outcome}_rate"])

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(self.state)

    def restore(self, data: bytes) -> None:
        if data:
            self.state = msgspec.msgpack.decode(data, type=EvalState)
