"""Algorithm comparison: the embedded default (Tic-Tac-Toe against the random opponent) trained with each
advantage estimator and the main loss options, on the same budget and seeds, one run at a time.

    python bench/algorithms.py --minutes 5 --seeds 0 1       # 11 configurations x 2 seeds x 5 min
    python bench/algorithms.py --quick                       # 1.5 minutes, seed 0: checks the pipeline

Writes bench/results/algorithms.json: `runs` (one per configuration and seed: `advantage`, `options`,
`seed`, `final_win_rate`, `mean_win_rate_second_half`, `min_win_rate_second_half`, `time_to_target_s`,
`steps`, and `exact_win_rate`: the final checkpoint's own win rate at the rollout temperature against the
random opponent, from `bench/policy_audit.py`, free of a window's ~0.01-0.02 sampling error) and `configs`
(per configuration over its seeds: mean and spread of those figures), and prints the table. Rates are over
the last `--window` games, as in bench/learning.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import run_curve, summarize  # noqa: E402
from policy_audit import audit  # noqa: E402

from bench.provenance import write_result  # noqa: E402
from earl_stream.progress import progress  # noqa: E402

# (advantage, extra options): every estimator with the defaults, then the main loss options on grpo
CONFIGS: list[tuple[str, list[str]]] = [
    ("grpo", []),
    ("grpo", ["algo.std_scale=false"]),
    ("dr_grpo", ["algo.loss_agg=seq-mean-token-sum"]),
    ("rloo", []),
    ("reinforce_pp", []),
    ("reinforce_pp_baseline", []),
    ("grpo", ["algo.dynamic_sampling=true"]),
    ("grpo", ["algo.clip_eps_high=0.28"]),
    ("grpo", ["algo.ppo_epochs=2"]),
    ("grpo", ["algo.is_correction=mask"]),
    ("grpo", ["algo.positive_weight=0.3"]),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="time budget of each run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--quick", action="store_true", help="1.5 minutes per run, seed 0")
    ap.add_argument("--window", type=int, default=512, help="games in the rolling window of the rates")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--only", default="", help="run only configurations whose label contains this text")
    ap.add_argument("--json", default="bench/results/algorithms.json")
    ap.add_argument("--add", action="store_true", help="keep the runs already in --json (other seeds or "
                    "configurations, same budget) and add these; a configuration and seed run again replaces its "
                    "old run")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.seeds = min(args.minutes, 1.5), [0]
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    kept: list[dict] = []
    if args.add and out.exists():
        old = json.loads(out.read_text())
        if old.get("budget_minutes") != args.minutes or old.get("overrides", []) != args.overrides:
            raise SystemExit(f"--add: {out} holds runs of {old.get('budget_minutes')} minutes with overrides "
                             f"{old.get('overrides')}, not {args.minutes} and {args.overrides}: they would not compare")
        kept = old.get("runs", [])
    runs = []
    chosen = [(advantage, options) for advantage, options in CONFIGS if args.only in label(advantage, options)]
    with progress(f"algorithms ({args.minutes:g} min a run)", len(chosen) * len(args.seeds), "runs") as bar:
        for advantage, options, seed in ((a, o, s) for a, o in chosen for s in args.seeds):
            bar.update(bar.done, note=f"{label(advantage, options)} seed {seed}")
            start = time.monotonic()
            run_dir = out.parent / "algorithms_run"
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the final one audited is this run's
            curve = run_curve([f"algo.advantage={advantage}", *options, f"seed={seed}", *args.overrides],
                              minutes=args.minutes, window=args.window, every=10.0,
                              run_dir=run_dir)
            wall = round(time.monotonic() - start, 1)
            s = summarize(curve, args.target, args.minutes)
            exact = final_audit(run_dir, [*options, *args.overrides])
            runs.append({"advantage": advantage, "options": options, "seed": seed,
                         **{k: s[k] for k in ("final_win_rate", "mean_win_rate_second_half", "min_win_rate_second_half",
                                              "max_win_rate", "time_to_target_s", "steps")},
                         "exact_win_rate": exact,
                         "filtered_samples": curve[-1].get("filtered", 0) if curve else 0, "wall_seconds": wall})
            print(json.dumps(runs[-1]), flush=True)
            bar.advance()
    machine = {"cores": os.cpu_count(), "load_avg_before": load_before,
               "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    new = {(label(r["advantage"], r["options"]), r["seed"]) for r in runs}
    runs = [r for r in kept if (label(r["advantage"], r["options"]), r["seed"]) not in new] + runs
    result = {"machine": machine, "budget_minutes": args.minutes, "seeds": sorted({r["seed"] for r in runs}),
              "window_games": args.window, "target_win_rate": args.target, "overrides": args.overrides, "runs": runs,
              "configs": aggregate(runs)}
    write_result(out, result, indent=2)
    print(table(result["configs"]))
    return 0


def final_audit(run_dir: Path, overrides: list[str]) -> float | None:
    """The exact win rate of the run's final checkpoint (Tic-Tac-Toe at the rollout's temperature), or None
    for another environment or a run that wrote no checkpoint."""
    from earl_stream.config import load_config

    cfg = load_config(None, overrides)
    latest = run_dir / "checkpoints" / "latest"
    if cfg.envs[0].spec != "tictactoe" or not latest.exists():
        return None
    return audit(str(latest.parent / latest.read_text().strip()), temperature=cfg.rollout.temperature).outcomes["win"]


def label(advantage: str, options: list[str]) -> str:
    return " ".join([advantage, *(o.removeprefix("algo.") for o in options)])


def aggregate(runs: list[dict]) -> list[dict]:
    """Per configuration: the mean over its seeds of each figure and the spread (max - min) of the
    second-half mean."""
    out = []
    for advantage, options in CONFIGS:
        mine = [r for r in runs if r["advantage"] == advantage and r["options"] == options]
        if not mine:
            continue

        def mean(key: str, rows: list[dict] = mine) -> float | None:
            vals = [r[key] for r in rows if r[key] is not None]
            return round(statistics.mean(vals), 4) if vals else None

        halves = [r["mean_win_rate_second_half"] for r in mine if r["mean_win_rate_second_half"] is not None]
        out.append({"config": label(advantage, options), "seeds": len(mine), "final_win_rate": mean("final_win_rate"),
                    "mean_win_rate_second_half": mean("mean_win_rate_second_half"),
                    "min_win_rate_second_half": min((r["min_win_rate_second_half"] for r in mine
                                                     if r["min_win_rate_second_half"] is not None), default=None),
                    "spread_second_half_mean": round(max(halves) - min(halves), 4) if halves else None,
                    "time_to_target_s": mean("time_to_target_s"), "steps": mean("steps"),
                    "exact_win_rate": mean("exact_win_rate")})
    return out


def table(configs: list[dict]) -> str:
    lines = ["| configuration | seeds | final | 2nd-half mean | 2nd-half min | spread | to 0.9 (s) | steps | exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        lines.append(f"| {c['config']} | {c['seeds']} | {c['final_win_rate']} | {c['mean_win_rate_second_half']} | "
                     f"{c['min_win_rate_second_half']} | {c['spread_second_half_mean']} | {c['time_to_target_s']} | "
                     f"{c['steps']} | {c.get('exact_win_rate')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
