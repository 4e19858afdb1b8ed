"""EARL's motivating experiment: contexts grow during training; a static context limit vs the selector.

    python bench/context_growth.py --json bench/results/context_growth.json [--quick] [--minutes M]

Two `earl-stream up` runs on the same seeds, machine, per-rank memory cap and time budget, on
`tictactoe_match` with a growth curriculum: an episode is a match of Tic-Tac-Toe games in one
conversation, one more game (~110 tokens) every --grow-every prompt groups, and the match is scored
once, at its end (the fraction of its games won), so the reward needs the whole episode:
- static: the plan sized for --limit tokens at the start and never re-selected (selector.upper_factor
  set out of reach), and the usual remedy, a hard context limit: an episode that reaches --limit
  tokens ends `truncated` (reward 0, as a reasoning trace cut off before its answer);
- adaptive: the selector on (it re-plans parallelism, micro-batch and recomputation as the context
  percentiles cross its thresholds), no context limit;
- with --unbounded, a third run, static_unbounded: the static plan without the limit (why users set one).
The trainer pools have two ranks, each under a real memory cap: once the pool has trained its first
step (so that start-up and the first step's allocations, the same in every run, are each rank's
baseline), a rank is moved into a memory cgroup of its own whose limit is what is charged there plus --cap-mib
(bench/memcap.py; past it the kernel OOM-kills the rank: a crash), and the selector's memory budget is
the same --cap-mib, of which it keeps --reserve-mib free. The trainer ranks return freed tensors to the OS
(trainer.malloc_mmap_threshold, --malloc-mmap-threshold), so that their resident memory follows the live
tensors the memory model counts, as a GPU's caching allocator reuses freed blocks; with glibc's default
heap a long-lived rank grew past its plan's prediction step after step (run 2 of the results).
Every --every seconds the status gives: step, success (mean reward over the last episodes: the
fraction of a match's games won), context-length percentiles, the trainer plan in force, the outcome
fractions (truncated), and each rank's peak memory in its cgroup against the cap. JSON keys:
`static_final_success`, `adaptive_final_success`, `static_truncated_fraction`, `adaptive_crashed`,
`plans_used` (of the adaptive run), plus both curves; a two-panel PNG (context length and success
over steps). Needs root and a memory cgroup controller; without them it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from live_up import LiveUp  # noqa: E402  (bench/, beside this script)
from memcap import MemoryCaps, problems  # noqa: E402

from bench.provenance import write_result  # noqa: E402


def _plan_name(plan: dict[str, Any]) -> str | None:
    """A trainer plan (the status's wire form) as a short name, e.g. "dp2/256", "fsdp2+rc/512", "sp2+rc/1024"."""
    if not plan:
        return None
    parts = [f"fsdp{plan['fsdp']}" if plan["fsdp"] > 1 else f"dp{plan['dp']}"] * (plan["dp"] * plan["fsdp"] > 1)
    parts += [f"{k}{plan[k]}" for k in ("tp", "sp") if plan[k] > 1]
    parts += ["rc"] * bool(plan["recompute"])
    return "+".join(parts or ["dp1"]) + f"/{plan['micro_batch_tokens']}"


def run(kind: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    cap = args.cap_mib << 20
    params = {"games": args.games, "max_games": args.max_games, "grow_every": args.grow_every}
    overrides = [f"seed={args.seed}", "envs.0.spec=tictactoe_match", "envs.0.name=tictactoe_match", "trainer.nproc=2",
                 f"selector.trainer_memory_bytes={cap}", f"selector.reserve_bytes={args.reserve_mib << 20}",
                 "selector.context_window=64", "selector.min_episodes_between=32", "supervisor.stats_window=128",
                 "trainer.checkpoint_every=1000", f"trainer.malloc_mmap_threshold={args.malloc_mmap_threshold}"]
    if kind.startswith("static"):
        if kind == "static":
            params["max_episode_tokens"] = args.limit
        overrides += [f"selector.initial_seq_len={args.limit}", "selector.upper_factor=1000", "selector.lower_factor=0.001"]
    else:
        overrides += [f"selector.initial_seq_len={args.initial_len}"]
    overrides.append("envs.0.params=" + json.dumps(params).replace('"', ""))
    run_dir = out_dir / f"context_growth_{kind}_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    up = LiveUp(run_dir, "--steps", "0", *overrides, log=run_dir / "up.log")
    caps = MemoryCaps(kind)
    proc = up.proc
    curve: list[dict[str, Any]] = []
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
            for w in trainers:  # capped once the first step is trained: its warm-up is the rank's baseline
                if s["policy_version"] >= 1 and w["alive"] and w["pid"] not in caps.limits \
                        and Path(f"/proc/{w['pid']}").exists():
                    caps.cap(w["pid"], cap)
            killed = sum(caps.oom_kills(pid) for pid in caps.limits)
            dead = [w["id"] for w in trainers if not w["alive"]]
            if dead or killed:
                crashed = f"trainer rank(s) {', '.join(dead) or '?'} died ({killed} OOM kill(s) in their cgroups)"
                break
            plan = (s.get("plans") or {}).get("trainer") or {}
            point = {"t": round(time.monotonic() - start, 1), "step": s["policy_version"],
                     "success": s["mean_reward_last"], "context": s.get("context_length", {}),
                     "plan": _plan_name(plan), "design_len": plan.get("design_seq_len"),
                     "predicted_peak_mib": round(plan.get("predicted_peak_bytes", 0) / 2**20, 1),
                     "truncated": (s.get("outcomes_last") or {}).get("truncated", 0.0),
                     "peak_mib_above_start": [round((caps.peak(pid) - lim + cap) / 2**20, 1)
                                              for pid, lim in caps.limits.items()]}
            curve.append(point)
            print(kind, json.dumps(point), flush=True)
            time.sleep(args.every)
    finally:
        up.stop()
        caps.close()
    scored = [p for p in curve if p["success"] is not None]
    tail = scored[-max(1, len(scored) // 5):] if scored else []
    peaks = [m for p in curve for m in p["peak_mib_above_start"]]
    return {"curve": curve, "crashed": crashed,
            "final_success": round(sum(p["success"] for p in tail) / len(tail), 4) if tail else None,
            "best_success": max((p["success"] for p in scored), default=None),
            "truncated_fraction": round(sum(p["truncated"] for p in tail) / len(tail), 4) if tail else None,
            "plans_used": sorted({p["plan"] for p in curve if p["plan"]}, key=[p["plan"] for p in curve].index),
            "max_context_p99": max((p["context"].get("p99", 0) for p in curve), default=0),
            "peak_mib_above_start": max(peaks, default=None), "cap_mib": args.cap_mib,
            "steps": curve[-1]["step"] if curve else 0}


def plot(static: dict[str, Any], adaptive: dict[str, Any], path: Path, limit: int,
         unbounded: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    runs = [(f"static (limit {limit})", static, "tab:red"), ("adaptive (selector)", adaptive, "tab:blue")]
    if unbounded is not None:
        runs.append(("static plan, no limit", unbounded, "tab:orange"))
    for name, r, color in runs:
        pts = [p for p in r["curve"] if p["context"]]
        top.plot([p["step"] for p in pts], [p["context"].get("p99", 0) for p in pts], color=color, label=name + " p99")
        top.plot([p["step"] for p in pts], [p["context"].get("p50", 0) for p in pts], color=color, ls=":")
        scored = [p for p in r["curve"] if p["success"] is not None]
        bottom.plot([p["step"] for p in scored], [p["success"] for p in scored], color=color, label=name)
    top.axhline(limit, color="grey", ls="--", lw=0.8)
    top.set_ylabel("episode context (tokens)")
    top.legend(fontsize=8)
    bottom.set_ylabel("success (games won, last episodes)")
    bottom.set_xlabel("training step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/context_growth.json")
    ap.add_argument("--quick", action="store_true", help="3 minutes per run (checks the pipeline, not the goal)")
    ap.add_argument("--minutes", type=float, default=10.0, help="time budget of each run")
    ap.add_argument("--limit", type=int, default=384, help="the static run's context limit (tokens)")
    ap.add_argument("--cap-mib", type=int, default=56, help="memory cap per trainer rank above its size after the first step")
    ap.add_argument("--reserve-mib", type=int, default=8, help="of the cap, what the selector keeps free")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=65536,
                    help="the trainer ranks' trainer.malloc_mmap_threshold (0: glibc's default heap, whose freed blocks "
                         "stay resident and grow a long-lived rank past the memory model)")
    ap.add_argument("--initial-len", type=int, default=256, help="the adaptive run's first design length (tokens)")
    ap.add_argument("--games", type=int, default=1, help="games per match at the start")
    ap.add_argument("--max-games", type=int, default=8, help="games per match at the end of the curriculum")
    ap.add_argument("--grow-every", type=int, default=40, help="prompt groups (per rollout worker) per curriculum level")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between curve points")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("static", "adaptive", "static_unbounded"),
                    help="run only this one and add it to the JSON at --json (e.g. static_unbounded after a full run)")
    ap.add_argument("--unbounded", action="store_true",
                    help="also run the static plan without the context limit (static_unbounded: why users set one)")
    args = ap.parse_args()
    if args.quick:
        args.minutes = min(args.minutes, 3.0)
    if problems():
        print("bench/context_growth.py needs " + "; ".join(problems()), file=sys.stderr)
        return 2
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only:  # one run, added to (or replacing its entry in) the JSON at --json
        result = json.loads(out.read_text()) if out.exists() else {}
        result[args.only] = run(args.only, args, out.parent)
        result["settings_" + args.only] = {k: v for k, v in vars(args).items() if k != "json"}
        write_result(out, result, indent=1)
        return 0
    static = run("static", args, out.parent)
    adaptive = run("adaptive", args, out.parent)
    unbounded = run("static_unbounded", args, out.parent) if args.unbounded else None
    result = {
        "static_final_success": static["final_success"], "adaptive_final_success": adaptive["final_success"],
        "static_truncated_fraction": static["truncated_fraction"], "adaptive_crashed": bool(adaptive["crashed"]),
        "static_crashed": bool(static["crashed"]), "plans_used": adaptive["plans_used"],
        "static_plans_used": static["plans_used"],
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "static": static, "adaptive": adaptive,
    }
    if unbounded is not None:
        result["static_unbounded"] = unbounded
    write_result(out, result, indent=1)
    plot(static, adaptive, out.with_suffix(".png"), args.limit, unbounded)
    print(json.dumps({k: v for k, v in result.items() if k not in ("static", "adaptive", "static_unbounded")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
