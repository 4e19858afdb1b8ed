"""`earl-stream runs show RUN_DIR` and `earl-stream runs compare RUN_DIR... --metric M --out FILE.png`: read
the per-step record the supervisor writes (`RUN_DIR/metrics.jsonl`, supervisor/metrics_log.py) back as a
table, as JSON, or as one plot of several runs. Works on finished runs: nothing here talks to a live one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from earl_stream.errors import ConfigError
from earl_stream.supervisor.metrics_log import FILE_NAME, read_records

# (record field, column heading, format) of the table `runs show` prints
COLUMNS = (("step", "step", "d"), ("wall_seconds", "wall_s", ".0f"), ("reward", "reward", ".3f"),
           ("win_rate", "win", ".2f"), ("loss", "loss", ".4f"), ("kl", "kl", ".4f"), ("entropy", "entropy", ".3f"),
           ("clip_frac", "clip", ".3f"), ("grad_norm", "grad_norm", ".3f"), ("trained_tokens_per_s", "train_tok/s", ".0f"),
           ("rollout_tokens_per_s", "roll_tok/s", ".0f"), ("context_p50", "ctx_p50", ".0f"),
           ("context_p99", "ctx_p99", ".0f"), ("plan", "plan", "s"), ("peak_memory_bytes", "peak_GiB", "gib"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("runs", help="per-step metrics of finished or running runs (RUN_DIR/metrics.jsonl)")
    rsub = p.add_subparsers(dest="runs_command", required=True)
    show = rsub.add_parser("show", help="print a run's per-step metrics as a table (or JSON)")
    show.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or its metrics.jsonl)")
    show.add_argument("--json", action="store_true", help="print the records as one JSON list instead")
    show.add_argument("--last", type=int, default=0, metavar="N", help="only the last N steps (0 = all)")
    cmp = rsub.add_parser("compare", help="plot chosen metrics of several runs per step into one PNG")
    cmp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or their metrics.jsonl)")
    cmp.add_argument("--metric", action="append", default=[], metavar="NAME",
                     help="a record field to plot, one panel each; repeat it (default: reward and loss)")
    cmp.add_argument("--out", default="runs_compare.png", metavar="FILE.png", help="where the PNG goes")


def run_runs(args: argparse.Namespace) -> int:
    if args.runs_command == "show":
        records = _load(args.run_dir)
        if args.last > 0:
            records = records[-args.last:]
        print(json.dumps(records, indent=1) if args.json else format_table(records))
        return 0
    if args.runs_command == "compare":
        out = plot_runs({d: _load(d) for d in args.run_dirs}, args.metric or ["reward", "loss"], Path(args.out))
        print(f"wrote {out}")
        return 0
    raise AssertionError(args.runs_command)


def _load(run_dir: str) -> list[dict[str, Any]]:
    records = read_records(run_dir)
    if not records:
        raise ConfigError(f"{run_dir}: no per-step records (no {FILE_NAME} with a line in it; the supervisor "
                          "writes one line per trained step)")
    return sorted(records, key=lambda r: r["step"])


def format_table(records: list[dict[str, Any]]) -> str:
    """One row per step, one column per main metric; a value the record lacks is `-`."""
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in records)]
    rows = [[c[1] for c in cols]] + [[_cell(r.get(key), fmt) for key, _, fmt in cols] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _cell(v: Any, fmt: str) -> str:
    if v is None:
        return "-"
    if fmt == "gib":
        return f"{v / 2**30:.2f}"
    if fmt == "s" or not isinstance(v, (int, float)):
        return str(v)
    return format(int(v) if fmt == "d" else v, fmt)


def plot_runs(runs: dict[str, list[dict[str, Any]]], metrics: list[str], path: Path) -> Path:
    """One panel per metric over training steps, one line per run (labelled by its directory)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training host (as cli/live.plot_learning_curve)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(metrics), 1, figsize=(8, 2.6 * len(metrics) + 0.6), sharex=True, squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics):
        for name, records in runs.items():
            points = [(r["step"], r[metric]) for r in records if isinstance(r.get(metric), (int, float))]
            ax.plot([s for s, _ in points], [v for _, v in points], label=name)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("training step (policy version)")
    fig.suptitle(f"earl_stream runs: {', '.join(metrics)}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
