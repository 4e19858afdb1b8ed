"""Learning benchmark: run the embedded default (`earl-stream up`) for a fixed time budget and
record the win/draw/loss curve against the random opponent.

    python bench/learning.py --minutes 15 --json bench/results/learning.json [overrides...]
    python bench/learning.py --env connect_four --minutes 15      # bench/results/learning_connect_four.json

Writes the curve as JSON and a PNG next to it. Rates are over the last `--window` (512) games. A player
making random legal moves as X wins about 0.58 of its Tic-Tac-Toe games. Goals (2 cores, 15
minutes): win rate >= 0.9 within 5 minutes (`time_to_target_s`), then second-half mean >= 0.95 and
second-half minimum >= 0.9. Each point also carries every outcome's rate (`outcomes`: win, draw, loss,
illegal) and the window's standard error clustered by GRPO group (`win_stderr`: where a group's games share
a seed, `envs.0.group_seed=shared`, 512 games of 64 groups are far fewer than 512 independent draws), and the
summary its median over the second half.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from pipeline_rates import start_up
from provenance import write_result

from earl_stream import protocol as P
from earl_stream.errors import EarlError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="time budget of the run")
    ap.add_argument("--quick", action="store_true", help="a 2-minute pass (checks the pipeline, not the target)")
    ap.add_argument("--json", default="bench/results/learning.json", help="where to write the curve")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between curve points")
    ap.add_argument("--target", type=float, default=0.9, help="win rate to report the time to (time_to_target_s)")
    ap.add_argument("--window", type=int, default=512, help="games in the rolling window of the rates")
    ap.add_argument("--env", default="tictactoe", help="environment against its random opponent: tictactoe (the "
                    "embedded default) or connect_four (its own curve, by default in learning_connect_four.json)")
    ap.add_argument("overrides", nargs="*", help="config overrides passed to `earl-stream up`")
    args = ap.parse_args()
    if args.quick:
        args.minutes = min(args.minutes, 2.0)
    if args.env != "tictactoe":
        args.overrides = [f"envs.0.spec={args.env}", *args.overrides]
        if args.json == ap.get_default("json"):
            args.json = f"bench/results/learning_{args.env}.json"
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    curve = run_curve(args.overrides, minutes=args.minutes, window=args.window, every=args.every,
                      run_dir=out.parent / f"{out.stem}_run", summary=out.with_suffix(".summary.json"))
    result = {**summarize(curve, args.target, args.minutes), "env": args.env, "window_games": args.window,
              "overrides": args.overrides}
    write_result(out, result)
    plot(curve, out.with_suffix(".png"), args.target, args.env, args.window)
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}, indent=2))
    return 0


def run_curve(overrides: list[str], *, minutes: float, window: int, every: float, run_dir: Path,
              summary: Path | None = None) -> list[dict]:
    """Run `earl-stream up` with `overrides` in `run_dir` for `minutes` and return its curve: one point
    every `every` seconds with the win/draw/loss rates over the last `window` games."""
    cmd = [sys.executable, "-m", "earl_stream", "up", f"run_dir={run_dir}", f"supervisor.stats_window={window}",
           *overrides]
    if summary is not None:
        cmd[4:4] = ["--summary", str(summary)]
    proc, client = start_up(cmd, run_dir, wait_s=0.5)
    curve: list[dict] = []
    try:
        start = time.monotonic()
        while time.monotonic() - start < minutes * 60 and proc.poll() is None:
            time.sleep(every)
            try:
                s = json.loads(client.call(P.StatusRequest()).status_json)
            except EarlError:
                continue
            if s.get("win_rate_last") is None:
                continue
            win, draw = s["win_rate_last"], s["draw_rate_last"]
            point = {"t": round(time.monotonic() - start, 1), "step": s["policy_version"], "win": win, "draw": draw,
                     "loss": 1 - win - draw, "reward": s["mean_reward_last"], "episodes": s["samples_produced"],
                     "filtered": s.get("samples_filtered", 0), "full": s["samples_produced"] >= window,
                     # the window's standard error clustered by group, and its groups (a group shares a prompt)
                     "win_stderr": s.get("win_rate_stderr_last"), "groups": s.get("groups_last"),
                     "outcomes": s.get("outcomes_last", {})}
            curve.append(point)
            print(json.dumps(point), flush=True)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return curve


def summarize(curve: list[dict], target: float, minutes: float) -> dict:
    """The run's figures from its curve. Only points whose window is full count (`full`, set by the
    caller when the run has played at least a window of games)."""
    curve = [p for p in curve if p.get("full", True)] or curve
    reached = next((p for p in curve if p["win"] >= target), None)
    late = [p["win"] for p in curve[len(curve) // 2:]]
    late_se = [p["win_stderr"] for p in curve[len(curve) // 2:] if p.get("win_stderr") is not None]
    late_groups = [p["groups"] for p in curve[len(curve) // 2:] if p.get("groups")]
    late_outcomes = [p["outcomes"] for p in curve[len(curve) // 2:] if p.get("outcomes")]
    outcome_names = sorted({o for rates in late_outcomes for o in rates})
    return {
        "budget_minutes": minutes, "cores": os.cpu_count(), "target_win_rate": target,
        "start_win_rate": curve[0]["win"] if curve else None,
        "final_win_rate": curve[-1]["win"] if curve else None,
        "max_win_rate": max((p["win"] for p in curve), default=None),
        "time_to_target_s": reached["t"] if reached else None,
        # how well the win rate holds once learnt, not only its peak
        "mean_win_rate_second_half": round(statistics.mean(late), 4) if late else None,
        "min_win_rate_second_half": min(late, default=None),
        # how far one window's rate is from the policy's by chance alone (a minimum over many windows sits
        # ~2-3 of these below the mean even when the policy does not move)
        "median_win_stderr_second_half": round(statistics.median(late_se), 4) if late_se else None,
        "median_groups_per_window_second_half": statistics.median(late_groups) if late_groups else None,
        # where the games that are not won go (an illegal reply, a loss, a draw)
        "mean_outcomes_second_half": {o: round(statistics.mean(r.get(o, 0.0) for r in late_outcomes), 4)
                                      for o in outcome_names},
        "steps": curve[-1]["step"] if curve else 0,
        "curve": curve,
    }


def plot(curve: list[dict], path: Path, target: float, env: str = "tictactoe", window: int = 512) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not curve:
        return
    t = [p["t"] / 60 for p in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, [p["win"] for p in curve], label="win")
    banded = [(x, p) for x, p in zip(t, curve) if p.get("win_stderr") is not None]
    if banded:
        ax.fill_between([x for x, _ in banded], [p["win"] - 2 * p["win_stderr"] for _, p in banded],
                        [p["win"] + 2 * p["win_stderr"] for _, p in banded], alpha=0.2, label="win +- 2 s.e. (by group)")
    ax.plot(t, [p["draw"] for p in curve], label="draw")
    ax.plot(t, [p["loss"] for p in curve], label="loss (incl. illegal)")
    if any("illegal" in p.get("outcomes", {}) for p in curve):
        ax.plot(t, [p.get("outcomes", {}).get("illegal", 0.0) for p in curve], ls="--", label="illegal reply")
    if env == "tictactoe":
        ax.axhline(0.58, ls=":", c="gray", label="random legal play (win)")
    ax.axhline(target, ls="--", c="green", label=f"target {target}")
    ax.set_xlabel("minutes")
    ax.set_ylabel(f"rate over the last {window} episodes")
    ax.set_ylim(0, 1)
    ax.legend(loc="center right", fontsize=8)
    ax.set_title(f"earl_stream: {env} vs random opponent")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
