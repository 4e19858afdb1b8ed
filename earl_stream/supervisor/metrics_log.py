"""The run's per-step record, `RUN_DIR/metrics.jsonl`: one JSON object per training step, appended by the
supervisor when the trainer publishes the step's weights (`protocol.PublishVersion`).

It owns the file and the record's fields; what goes in a record comes from the supervisor's own status
(`Supervisor.status`) and the trainer's step metrics, never recomputed here. Reading the file back for
people (`earl-stream runs show/compare`) is left to `cli/runs_cmd.py`.

Steps count trained steps from 1: the record of step s is the one the trainer published as policy version s
(the learning curve's x axis). A value the supervisor does not know is null, never guessed. Besides the
trainer's step metrics a record holds what the supervisor sees at that step: the episode window (reward,
win/draw rate, each environment's outcomes, context-length percentiles), the staleness of the step's
samples (`staleness`: versions between each sample's oldest token and the policy it trained -> samples,
read from the ledger's claim of the step), rollout throughput and the largest store a rollout worker holds,
the trainer plan and any re-plan, and the evaluation rounds (eval.every) that finished since the last record
(`eval`: env -> the new points, oldest first; the last step's record is written once the final version's round
finished, eval.final_timeout_s, so that it holds it). `summary.json` and `learning_curve.png` are made from these
records when the run ends (`cli/run_files.py`).

Durable across a restart: a reopened log reads the last step already written and skips every step at or
below it, so a step replayed from the write-ahead log, or re-trained after a resume rolled the trainer back,
is never written twice (the first record of a step stands). A file left by an earlier run in the same
directory (another `run_id`) is moved aside to `metrics-<run_id>.jsonl`, not appended to.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "metrics.jsonl"
# the trainer's step metrics copied into the record under their own names (workers/train_step.StepResult)
TRAINER_FIELDS = ("loss", "kl", "entropy", "clip_frac", "grad_norm", "lr", "tokens", "samples", "step_seconds",
                  "stale_frac", "masked_frac", "peak_memory_bytes")
CONTEXT_FIELDS = ("p50", "p90", "p99", "max")  # the episode window's context-length percentiles, tokens


class MetricsLog:
    """Appends one line per step to `run_dir/metrics.jsonl` (flushed per line) and skips steps already there.
    The last step's record can be held (`hold`) until the final evaluation round is played, then written with
    the rounds that finished since (`release`); a supervisor snapshot keeps it (`held_json`, `restore_held`)."""

    def __init__(self, run_dir: str | os.PathLike[str], run_id: str = "") -> None:
        self.path = Path(run_dir) / FILE_NAME
        self.run_id = run_id
        self.last_step = -1  # the last step written (-1: none)
        self.started = time.time()  # the run's start, for wall_seconds (kept from the file's first record)
        self._rollout: tuple[float, float] | None = None  # (time, tokens_produced) at the last record
        self._eval_seen: dict[str, int] = {}  # env -> the newest evaluated version already in a record
        self._held: tuple[int, dict[str, Any]] | None = None  # (step, record) waiting for the final round
        self._open_existing()

    def _open_existing(self) -> None:
        if self.path.exists() and not self.path.read_bytes().endswith(b"\n"):
            with self.path.open("a") as f:  # a line cut short by a crash: the next record starts a line of its own
                f.write("\n")
        records = read_records(self.path)
        if not records:
            return
        if self.run_id and records[-1].get("run_id", self.run_id) != self.run_id:
            aside = self.path.with_name(f"metrics-{records[-1]['run_id']}.jsonl")
            self.path.rename(aside)
            log.info("%s belonged to an earlier run: moved to %s", self.path, aside)
            return
        self.last_step = max(int(r["step"]) for r in records)
        for r in records:
            for env, points in (r.get("eval") or {}).items():
                self._eval_seen[env] = max([self._eval_seen.get(env, -1)] + [int(p["version"]) for p in points])
        first = records[0]
        if isinstance(first.get("time"), (int, float)) and isinstance(first.get("wall_seconds"), (int, float)):
            self.started = first["time"] - first["wall_seconds"]

    def append(self, step: int, record: dict[str, Any]) -> bool:
        """Write `record` as step `step` unless a step at or after it is already written; True when written."""
        if step <= self.last_step:
            return False
        full = {"step": step, **record, **({"run_id": self.run_id} if self.run_id else {})}
        line = json.dumps(_finite(full), default=_null)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(line + "\n")
                f.flush()
        except OSError as exc:  # the record is lost, the run goes on: the control plane never waits on it
            log.warning("cannot append step %d to %s: %s", step, self.path, exc)
            return False
        self.last_step = step
        return True

    def record(self, status: dict[str, Any], trainer: dict[str, float], replanned: bool,
               staleness: dict[str, int] | None = None) -> dict[str, Any]:
        """The record of the step just published, from the supervisor's `status`, the trainer's metrics and
        the staleness histogram of the step's claim (`staleness_histogram`; None: unknown)."""
        now = time.time()
        rec: dict[str, Any] = {"policy_version": status.get("policy_version"), "time": round(now, 3),
                               "wall_seconds": round(now - self.started, 3)}
        rec["reward"] = trainer.get("mean_reward")  # the step's trained batch
        rec["reward_window"] = status.get("mean_reward_last")  # the supervisor's last-episodes window
        rec["win_rate"] = status.get("win_rate_last")
        rec["draw_rate"] = status.get("draw_rate_last")
        rec["env_outcomes"] = {name: e["outcomes"] for name, e in (status.get("envs") or {}).items()
                               if e.get("outcomes")} or None
        rec.update({k: trainer.get(k) for k in TRAINER_FIELDS})
        seconds, tokens = trainer.get("step_seconds"), trainer.get("tokens")
        rec["trained_tokens_per_s"] = tokens / seconds if tokens is not None and seconds else None
        rec["rollout_tokens_per_s"] = self._rollout_rate(now, status.get("tokens_produced"))
        context = status.get("context_length") or {}
        for q in CONTEXT_FIELDS:
            rec[f"context_{q}"] = context.get(q)
        rec["staleness"] = staleness
        stores = [w["stats"]["store_bytes"] for w in status.get("workers") or []
                  if w.get("role") == "rollout" and w.get("alive") and "store_bytes" in (w.get("stats") or {})]
        rec["rollout_store_bytes_max"] = max(stores) if stores else None  # peak_memory_bytes: the trainer's
        plans = status.get("plans") or {}
        plan = plans.get("trainer") or {}
        rec["plan"], rec["plan_version"] = plan.get("name"), plan.get("version")
        rec["replanned"] = replanned
        rec["replan"] = _replan(plans.get("trainer_history") or [], status.get("policy_version")) if replanned else None
        rec["eval"] = self.new_eval_points(status.get("eval") or {})
        return rec

    def hold(self, step: int, record: dict[str, Any]) -> None:
        """Keep step `step`'s `record` unwritten until `release` (the final step's, waiting for its round)."""
        self._held = (step, record)

    def release(self, evals: dict[str, Any]) -> None:
        """Write the held record (if any) with the evaluation points of `evals` (status "eval") newer than it."""
        if self._held is None:
            return
        (step, rec), self._held = self._held, None
        later = self.new_eval_points(evals) or {}
        rec["eval"] = {env: (rec.get("eval") or {}).get(env, []) + later.get(env, [])
                       for env in {*(rec.get("eval") or {}), *later}} or None
        self.append(step, rec)

    def held_json(self) -> bytes:
        """The held record as JSON [step, record] (b"": none), for a snapshot."""
        return json.dumps(self._held).encode() if self._held else b""

    def restore_held(self, data: bytes) -> None:
        """Hold again what `held_json` gave."""
        if data:
            step, rec = json.loads(data)
            self._held = (int(step), rec)

    def new_eval_points(self, evals: dict[str, Any]) -> dict[str, list[dict[str, Any]]] | None:
        """env -> the evaluation points (status "eval" history) newer than any already recorded; the newest
        one in full (stderr, pass@k, the versions that played it). None when no round finished."""
        out: dict[str, list[dict[str, Any]]] = {}
        for env, e in evals.items():
            seen = self._eval_seen.get(env, -1)
            points = [dict(p) for p in e.get("history") or [] if p.get("value") is not None and p["version"] > seen]
            if not points:
                continue
            if e.get("version") == points[-1]["version"]:  # the latest round: every figure it has
                points[-1] = {k: v for k, v in e.items() if k not in ("history", "in_progress", "skipped_versions")}
            out[env] = points
            self._eval_seen[env] = points[-1]["version"]
        return out or None

    def _rollout_rate(self, now: float, produced: Any) -> float | None:
        """Tokens the rollout pool produced per second since the last record (None for the first one)."""
        if not isinstance(produced, (int, float)):
            return None
        before, self._rollout = self._rollout, (now, float(produced))
        if before is None or now <= before[0]:
            return None
        return (produced - before[1]) / (now - before[0])


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a directory holding one, or the file); [] when absent. A last line
    cut short by a crash is skipped."""
    p = Path(path)
    p = p / FILE_NAME if p.is_dir() else p
    if not p.exists():
        return []
    records = []
    for line in p.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: skipped a line that is not JSON (cut short by a crash?)", p)
    return [r for r in records if isinstance(r, dict) and "step" in r]


def _replan(history: Sequence[dict[str, Any]], version: Any) -> dict[str, Any] | None:
    """The plan the trainer pool adopted at the boundary of the step that made `version` (status
    plans.trainer_history, `PlanAdoption.to_dict`): its version, name and the selector's reason."""
    if not isinstance(version, int):
        return None
    adopted = [h for h in history[1:] if h.get("step") == version - 1]
    if not adopted:
        return None
    h = adopted[-1]
    return {"version": h.get("version"), "plan": (h.get("plan") or {}).get("name"), "reason": h.get("reason")}


def staleness_histogram(ledger: Any, step: int) -> dict[str, int] | None:
    """{versions stale: samples} of the samples claimed for (0-based) `step`: how many versions lie between a
    sample's oldest token and the policy the step trained (version `step`), as the trainer observes it
    (`earl_trainer_staleness_versions`). Read from `ledger` (`supervisor.ledger.Ledger`) while the step's
    claim is held (the trainer publishes before it releases); None when it is not. Samples with no model
    token (policy_version_min < 0) are not counted."""
    claim = ledger.claims.get(step)
    if claim is None:
        return None
    counts: dict[int, int] = {}
    for ordinal in claim[1]:
        group = ledger.groups.get(ordinal)
        for row in group.rows if group is not None else ():
            if row.policy_version_min >= 0:
                lag = max(0, step - row.policy_version_min)
                counts[lag] = counts.get(lag, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


def replanned_at(history: Sequence[Any], step: int) -> bool:
    """Whether the trainer pool adopted a new plan at the boundary of (0-based) `step`: an entry of the
    planner's `trainer_history` (`PlanAdoption`) there other than the run's first plan."""
    return any(h.step == step for h in history[1:])


def _finite(v: Any) -> Any:
    """`v` with NaN and infinities as None (JSON has neither), through dicts and lists."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _null(v: Any) -> None:
    return None
