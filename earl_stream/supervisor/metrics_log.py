"""The run's per-step record, `RUN_DIR/metrics.jsonl`: one JSON object per training step, appended by the
supervisor when the trainer publishes the step's weights (`protocol.PublishVersion`).

It owns the file and the record's fields; what goes in a record comes from the supervisor's own status
(`Supervisor.status`) and the trainer's step metrics, never recomputed here. Reading the file back for
people (`earl-stream runs show/compare`) is left to `cli/runs_cmd.py`.

Steps count trained steps from 1: the record of step s is the one the trainer published as policy version s
(the learning curve's x axis). A value the supervisor does not know is null, never guessed.

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


class MetricsLog:
    """Appends one line per step to `run_dir/metrics.jsonl` (flushed per line) and skips steps already there."""

    def __init__(self, run_dir: str | os.PathLike[str], run_id: str = "") -> None:
        self.path = Path(run_dir) / FILE_NAME
        self.run_id = run_id
        self.last_step = -1  # the last step written (-1: none)
        self.started = time.time()  # the run's start, for wall_seconds (kept from the file's first record)
        self._rollout: tuple[float, float] | None = None  # (time, tokens_produced) at the last record
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

    def record(self, status: dict[str, Any], trainer: dict[str, float], replanned: bool) -> dict[str, Any]:
        """The record of the step just published, from the supervisor's `status` and the trainer's metrics."""
        now = time.time()
        rec: dict[str, Any] = {"policy_version": status.get("policy_version"), "time": round(now, 3),
                               "wall_seconds": round(now - self.started, 3)}
        rec["reward"] = trainer.get("mean_reward")  # the step's trained batch
        rec["reward_window"] = status.get("mean_reward_last")  # the supervisor's last-episodes window
        rec["win_rate"] = status.get("win_rate_last")
        rec["env_outcomes"] = {name: e["outcomes"] for name, e in (status.get("envs") or {}).items()
                               if e.get("outcomes")} or None
        rec.update({k: trainer.get(k) for k in TRAINER_FIELDS})
        seconds, tokens = trainer.get("step_seconds"), trainer.get("tokens")
        rec["trained_tokens_per_s"] = tokens / seconds if tokens is not None and seconds else None
        rec["rollout_tokens_per_s"] = self._rollout_rate(now, status.get("tokens_produced"))
        context = status.get("context_length") or {}
        rec["context_p50"], rec["context_p99"] = context.get("p50"), context.get("p99")
        plan = (status.get("plans") or {}).get("trainer") or {}
        rec["plan"] = plan.get("name")
        rec["replanned"] = replanned
        return rec

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
