"""What `up` leaves in the run directory when a run ends besides the supervisor's own files: the parts of
`summary.json` that are about training steps, and `learning_curve.png`, both made from the per-step record
`RUN_DIR/metrics.jsonl` (supervisor/metrics_log.py), so that the summary, the curve, `runs show` and any
tracker agree on every step (a live view that polls the status every half second sees some steps and
misses others).

The record does not hold the run's counters (samples produced, lost, ...): those stay with the final status
(`up.make_summary`). An evaluation round that finishes after the last step has no step record to go in; the
curve takes it from the final status.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

# the trained step's figures the summary repeats from the last record ("last") and the user's first question
LAST_FIELDS = ("step", "policy_version", "wall_seconds", "reward", "reward_window", "win_rate", "draw_rate", "loss",
               "kl", "entropy", "clip_frac", "grad_norm", "lr", "plan")


def step_summary(records: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """The summary's `metrics` entry: the file, how many steps it holds, the last step's figures, and over all
    steps the mean throughputs, the largest memory and context figures, the re-plans and the staleness
    histogram summed. Absent values are skipped, an all-absent figure is None."""
    if not records:
        return {"file": str(path), "steps_recorded": 0}

    def values(key: str) -> list[float]:
        return [r[key] for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]

    def mean(key: str) -> float | None:
        v = values(key)
        return statistics.fmean(v) if v else None

    def top(key: str) -> float | None:
        v = values(key)
        return max(v) if v else None

    staleness: dict[str, int] = {}
    for r in records:
        for lag, n in (r.get("staleness") or {}).items():
            staleness[lag] = staleness.get(lag, 0) + n
    return {
        "file": str(path),
        "steps_recorded": len(records),
        "last": {k: records[-1].get(k) for k in LAST_FIELDS},
        "trained_tokens_per_s_mean": mean("trained_tokens_per_s"),
        "rollout_tokens_per_s_mean": mean("rollout_tokens_per_s"),
        "step_seconds_mean": mean("step_seconds"),
        "peak_memory_bytes": top("peak_memory_bytes"),  # the trainer's fullest rank, over the run
        "rollout_store_bytes_max": top("rollout_store_bytes_max"),
        "context_max": top("context_max"),
        "context_p99_max": top("context_p99"),
        "replans": sum(1 for r in records if r.get("replanned")),
        "staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))) or None,
    }


def eval_points(records: list[dict[str, Any]], final: dict[str, Any] | None = None) -> dict[str, list[tuple[int, float]]]:
    """env -> (version, held-out success) of every evaluation round in the records, with the rounds the final
    status (`status["eval"]`) knows beyond them, by version."""
    points: dict[str, dict[int, float]] = {}
    for r in records:
        for env, new in (r.get("eval") or {}).items():
            for p in new:
                if p.get("value") is not None:
                    points.setdefault(env, {})[int(p["version"])] = p["value"]
    for env, e in (final or {}).items():
        for p in e.get("history") or []:
            if p.get("value") is not None:
                points.setdefault(env, {}).setdefault(int(p["version"]), p["value"])
    return {env: sorted(by_version.items()) for env, by_version in points.items()}


def plot_learning_curve(records: list[dict[str, Any]], path: Path, evals: dict[str, Any] | None = None) -> Path | None:
    """Two panels over training steps (the records' `step`, = policy version): the trained batch's mean reward,
    the episode window's mean reward and win/draw rate, each evaluated environment's held-out success
    (`eval_points`), and the policy loss. None (no file) when no step was recorded."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a training host
    import matplotlib.pyplot as plt

    fig, (ax, ax_loss) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    for key, label in (("reward", "mean reward (trained batch)"), ("reward_window", "mean reward (last episodes)"),
                       ("win_rate", "win rate"), ("draw_rate", "draw rate")):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=label)
    for env, pts in eval_points(records, evals).items():
        ax.plot([v for v, _ in pts], [s for _, s in pts], marker="o", linestyle="--", label=f"held-out success ({env})")
    ax.set_ylabel("reward / rate")
    ax.set_ylim(-1.05, 1.05)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize="small")
    xs, ys = _series(records, "loss")
    ax_loss.plot(xs, ys, color="tab:gray")
    ax_loss.set_ylabel("policy loss")
    ax_loss.set_xlabel("training step (policy version)")
    ax_loss.grid(alpha=0.3)
    last = records[-1]
    wall = last.get("wall_seconds")
    fig.suptitle(f"earl_stream learning curve: {last['step']} steps" + (f" in {wall:.0f}s" if wall is not None else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]
