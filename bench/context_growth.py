"""EARL's motivating experiment: contexts grow during training; a static context limit vs the selector.

    python bench/context_growth.py --json bench/results/context_growth.json [--quick] [--minutes M]

Two `earl-stream up` runs on the same seeds, machine, per-rank memory cap and time budget, on
`long_recall` with a growth curriculum (one more fact turn, ~35 tokens, every --grow-every prompt
groups; the reward needs the whole context: the question asks for a fact shown turns earlier):
- static: the plan sized for --limit tokens at the start and never re-selected (selector.upper_factor
  set out of reach), and the usual remedy, a hard context limit: an episode that reaches --limit
  tokens ends `truncated` (reward 0);
- adaptive: the selector on (it re-plans parallelism, micro-batch and recomputation as the context
  percentiles cross its thresholds), no context limit.
Both trainer pools have two ranks, each under a real memory cap: once a rank has registered, its
RLIMIT_DATA is set to its data size then plus --cap-mib (`resource.prlimit`; an allocation past it
fails and the rank dies: a crash), and the selector's memory budget is the same --cap-mib.
Every --every seconds the status gives: step, success (mean reward over the last episodes: 1 =
correct answer), context-length percentiles, the trainer plan in force, the outcome fractions
(truncated), and each rank's peak resident memory (VmHWM). JSON keys: `static_final_success`,
`adaptive_final_success`, `static_truncated_fraction`, `adaptive_crashed`, `plans_used` (of the
adaptive run), plus both curves; a two-panel PNG (context length and success over steps).
Chance level: a guessed digit is right 1 time in 9 (0.11).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from live_up import LiveUp  # noqa: E402  (bench/, beside this script)


def _vm(pid: int, field: str) -> int:
    """A /proc/PID/status size field (VmData, VmHWM, ...) in bytes; 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run(kind: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    cap = args.cap_mib << 20
    params = {"turns": args.turns, "max_turns": args.max_turns, "grow_every": args.grow_every}
    overrides = [f"seed={args.seed}", "envs.0.spec=long_recall", "envs.0.name=long_recall", "trainer.nproc=2",
                 f"selector.trainer_memory_bytes={cap}", "selector.reserve_bytes=0", "selector.context_window=32",
                 "selector.min_episodes_between=16", "supervisor.stats_window=128", "trainer.checkpoint_every=1000"]
    if kind == "static":
        params["max_episode_tokens"] = args.limit
        overrides += [f"selector.initial_seq_len={args.limit}", "selector.upper_factor=1000", "selector.lower_factor=0.001"]
    else:
        overrides += [f"selector.initial_seq_len={args.turns * 40 + 64}"]
    overrides.append("envs.0.params=" + json.dumps(params).replace('"', ""))
    run_dir = out_dir / f"context_growth_{kind}_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    up = LiveUp(run_dir, "--steps", "0", *overrides, log=run_dir / "up.log")
    proc = up.proc
    curve: list[dict[str, Any]] = []
    capped: dict[int, int] = {}  # rank pid -> its RLIMIT_DATA
    crashed = ""
    try:
        up.wait(f"{kind}: the supervisor", up.ready.exists, 300)
        start = time.monotonic()
        while time.monotonic() - start < args.minutes * 60:
            if proc.poll() is not None:
                crashed = f"up exited with {proc.returncode}"
                break
            s = up.status()
            if s is None:
                time.sleep(1)
                continue
            trainers = [w for w in s["workers"] if w["role"] == "trainer"]
            for w in trainers:
                if w["alive"] and w["pid"] not in capped and _vm(w["pid"], "VmData"):
                    limit = _vm(w["pid"], "VmData") + cap
                    resource.prlimit(w["pid"], resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
                    capped[w["pid"]] = limit
            dead = [w["id"] for w in trainers if not w["alive"]]
            if dead:
                crashed = f"trainer rank(s) {', '.join(dead)} died"
                break
            plan = (s.get("plans") or {}).get("trainer") or {}
            point = {"t": round(time.monotonic() - start, 1), "step": s["policy_version"],
                     "success": s["mean_reward_last"], "context": s.get("context_length", {}),
                     "plan": plan.get("name"), "design_len": plan.get("design_seq_len"),
                     "truncated": (s.get("outcomes_last") or {}).get("truncated", 0.0),
                     "peak_rss_mib": [round(_vm(pid, "VmHWM") / 2**20, 1) for pid in capped]}
            curve.append(point)
            print(kind, json.dumps(point), flush=True)
            time.sleep(args.every)
    finally:
        up.stop()
    scored = [p for p in curve if p["success"] is not None]
    tail = scored[-max(1, len(scored) // 5):] if scored else []
    return {"curve": curve, "crashed": crashed,
            "final_success": round(sum(p["success"] for p in tail) / len(tail), 4) if tail else None,
            "truncated_fraction": round(sum(p["truncated"] for p in tail) / len(tail), 4) if tail else None,
            "plans_used": sorted({p["plan"] for p in curve if p["plan"]}, key=[p["plan"] for p in curve].index),
            "max_context_p99": max((p["context"].get("p99", 0) for p in curve), default=0),
            "steps": curve[-1]["step"] if curve else 0,
            "cap_bytes_above_start": cap, "rank_caps": list(capped.values())}


def plot(static: dict[str, Any], adaptive: dict[str, Any], path: Path, limit: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, r, color in ((f"static (limit {limit})", static, "tab:red"), ("adaptive (selector)", adaptive, "tab:blue")):
        pts = [p for p in r["curve"] if p["context"]]
        top.plot([p["step"] for p in pts], [p["context"].get("p99", 0) for p in pts], color=color, label=name + " p99")
        top.plot([p["step"] for p in pts], [p["context"].get("p50", 0) for p in pts], color=color, ls=":")
        scored = [p for p in r["curve"] if p["success"] is not None]
        bottom.plot([p["step"] for p in scored], [p["success"] for p in scored], color=color, label=name)
    top.axhline(limit, color="grey", ls="--", lw=0.8)
    top.set_ylabel("episode context (tokens)")
    top.legend(fontsize=8)
    bottom.axhline(1 / 9, color="grey", ls="--", lw=0.8, label="chance")
    bottom.set_ylabel("success (last episodes)")
    bottom.set_xlabel("training step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/context_growth.json")
    ap.add_argument("--quick", action="store_true", help="3 minutes per run (checks the pipeline, not the goal)")
    ap.add_argument("--minutes", type=float, default=15.0, help="time budget of each run")
    ap.add_argument("--limit", type=int, default=384, help="the static run's context limit (tokens)")
    ap.add_argument("--cap-mib", type=int, default=256, help="memory cap per trainer rank above its start-up size")
    ap.add_argument("--turns", type=int, default=2, help="fact turns at the start")
    ap.add_argument("--max-turns", type=int, default=20, help="fact turns at the end of the curriculum")
    ap.add_argument("--grow-every", type=int, default=6, help="prompt groups per curriculum level")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between curve points")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.minutes = min(args.minutes, 3.0)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    static = run("static", args, out.parent)
    adaptive = run("adaptive", args, out.parent)
    result = {
        "static_final_success": static["final_success"], "adaptive_final_success": adaptive["final_success"],
        "static_truncated_fraction": static["truncated_fraction"], "adaptive_crashed": bool(adaptive["crashed"]),
        "static_crashed": bool(static["crashed"]), "plans_used": adaptive["plans_used"],
        "static_plans_used": static["plans_used"], "chance_success": round(1 / 9, 4),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "static": static, "adaptive": adaptive,
    }
    out.write_text(json.dumps(result, indent=1))
    plot(static, adaptive, out.with_suffix(".png"), args.limit)
    print(json.dumps({k: v for k, v in result.items() if k not in ("static", "adaptive")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
