"""Recovery from out-of-memory errors: a run whose memory model is wrong on purpose meets real allocation failures and
recovers from each without a crash, a lost sample or a sample trained twice.

    make real-model   # SmolLM2-135M-Instruct into ~/.cache/earl_stream (once)
    python bench/oom_recovery.py --json bench/results/oom_recovery.json            # 3 repeats (~20 min each here)
    python bench/oom_recovery.py --repeats 1 --steps 4 --json /tmp/oom_quick.json  # a check (no failure yet)

Each repeat is one `earl-stream up` of bench/oom_recovery.yaml (SmolLM2-135M, a trainer pool of 2
ranks, key-value recall episodes that grow 8x, ~500 -> ~4,200 tokens, two steps per length) with the trainer
selector's memory predictions multiplied by `--scale` (`selector.memory_model_scale`, default 0.5: a model that
under-predicts by half; at 0.6 the plans it chose, dp2 then dp2 with recomputation, all fitted the cap).
Each rank runs under a real cap equal to the selector's per-rank budget (bench/real_scale_site:
setrlimit(RLIMIT_DATA) before it imports torch; torch then raises "can't allocate memory" past it, as CUDA
raises `OutOfMemoryError`), so the plans the wrong model believes fit fail to allocate for real as contexts
pass what the honest model would have allowed. `trainer.oom_recovery` (on) abandons the step on both ranks,
the supervisor corrects that layout's predictions and re-plans, and the same rows train again.

Recorded per repeat, from `up`'s summary and the trainer's log: `crashes` (a rank or `up` that died, or a
run that ended before its steps), `recoveries` (the supervisor's `oom_recoveries`: plan, micro-batch and
bytes before and after), `lost` (`samples_lost`), `duplicated` (`duplicates_detected`, and any step the
log shows trained twice), `seconds_lost_per_recovery` (from the failed attempt's start to the start of the
retry that trained, re-plan and re-layout included), each against `step_seconds` (the retried step's own
time: the goal is < 2 step times), and `plans` (every plan adopted, in order). Totals over the repeats and
the lost seconds' mean with a 95% interval are at the top level. `--reparse` rebuilds the result from the run
directories a campaign left (`bench_run.json` in each: how `up` ended).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.provenance import write_result  # noqa: E402
from bench.stats import mean_ci95  # noqa: E402

CONFIG = ROOT / "bench" / "oom_recovery.yaml"  # the workload, its own file
SITE = ROOT / "bench" / "real_scale_site"
_STEP = re.compile(r"step (\d+): loss \S+ grad-norm \S+ reward \S+ \((\d+) samples, (\d+) tokens\) in ([\d.]+)s")
_ADOPT = re.compile(r"step (\d+): adopted trainer plan v(\d+): (\S+) .*micro-batch (\d+) tokens, recompute (\w+)")
_LOST = re.compile(r"step (\d+): recovered from the allocation failure under (\S+): trained under plan (\S+), "
                   r"([\d.]+)s lost")
_LEFT = re.compile(r"step (\d+): every rank left the step ([\d.]+)s after it began")


def model_dir() -> Path:
    for line in CONFIG.read_text().splitlines():
        if line.strip().startswith("path:"):
            return Path(line.split(":", 1)[1].strip()).expanduser()
    raise SystemExit(f"{CONFIG} names no model.path")


def budget_bytes() -> int:
    for line in CONFIG.read_text().splitlines():
        if line.strip().startswith("trainer_memory_bytes:"):
            return int(line.split(":", 1)[1].split("#")[0])
    raise SystemExit(f"{CONFIG} names no selector.trainer_memory_bytes")


def parse_log(text: str, recoveries: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps trained (each rank logs each step), the plans adopted, and each retried step's lost seconds, per
    recovery (a step that failed under two plans before one held it is one retry of two recoveries: the lost
    seconds run from the first failed attempt's start to the start of the attempt that trained). The retry log
    names the step by its index, which is the trained step's number minus one."""
    trained: list[int] = []
    seconds: dict[int, float] = {}
    plans: list[dict[str, Any]] = []
    for m in _STEP.finditer(text):
        trained.append(int(m[1]))
        seconds[int(m[1])] = max(seconds.get(int(m[1]), 0.0), float(m[4]))
    for m in _ADOPT.finditer(text):
        if not any(p["version"] == int(m[2]) for p in plans):
            plans.append({"step": int(m[1]), "version": int(m[2]), "plan": m[3] + ("+rc" if m[5] == "True" else ""),
                          "micro_batch_tokens": int(m[4])})
    lost: dict[int, dict[str, Any]] = {}
    for m in _LOST.finditer(text):  # each rank logs it: the slowest rank's figure
        seen = lost.setdefault(int(m[1]), {"step": int(m[1]), "failed_plan": m[2], "retried_plan": m[3], "seconds": 0.0})
        seen["seconds"] = max(seen["seconds"], float(m[4]))
    left = [float(m[2]) for m in _LEFT.finditer(text)]
    for step, r in lost.items():
        r["recoveries"] = max(1, sum(1 for x in recoveries if x.get("step") == step))
        r["step_seconds"] = seconds.get(step + 1)  # the retried step, as it trained
        r["seconds_per_recovery"] = round(r["seconds"] / r["recoveries"], 3)
        r["step_times_per_recovery"] = (round(r["seconds_per_recovery"] / r["step_seconds"], 3)
                                        if r["step_seconds"] else None)
    return {"trained": trained, "step_seconds": seconds, "plans": plans, "lost": [lost[k] for k in sorted(lost)],
            "ranks_left_after_s": left}


def run_once(args: argparse.Namespace, k: int, out: Path) -> dict[str, Any]:
    run_dir = out / f"oom_recovery_{k}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cap = budget_bytes()
    env = {**os.environ, "PYTHONPATH": f"{SITE}:{ROOT}", "EARL_BENCH_RANK_CAP_BYTES": str(cap),
           "EARL_BENCH_CAP_MODE": "rlimit", "EARL_BENCH_CAP_TAG": f"oom{k}", "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, "-m", "earl_stream", "up", "--config", str(CONFIG), "--steps", str(args.steps),
           "--summary", str(run_dir / "summary.json"), f"run_dir={run_dir}", f"seed={args.seed + k}",
           f"selector.memory_model_scale={args.scale}", "trainer.oom_recovery=on",
           *args.set]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.run_minutes * 60)
    ended = {"seed": args.seed + k, "returncode": proc.returncode, "wall_seconds": round(time.monotonic() - t0, 1),
             "output_tail": (proc.stdout + proc.stderr)[-800:], "commit": _head()}
    (run_dir / "bench_run.json").write_text(json.dumps(ended))
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~1.6 GB of weights and AdamW state
    return collect(run_dir, ended, args.steps)


def _head() -> str:
    """The commit the run measured (a --reparse later may write the result at another)."""
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def collect(run_dir: Path, ended: dict[str, Any], wanted: int) -> dict[str, Any]:
    """One repeat's record from its run directory (the trainer's log, `up`'s summary) and how `up` ended."""
    log_file = run_dir / "logs" / "trainer.log"
    text = log_file.read_text(errors="replace") if log_file.exists() else ""
    got = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    recoveries = got.get("oom_recoveries", [])
    parsed = parse_log(text, recoveries)
    steps = got.get("steps", 0)
    ranks = 2
    twice = sorted({s for s in parsed["trained"] if parsed["trained"].count(s) > ranks})
    crashed = ended["returncode"] != 0 or steps < wanted
    return {
        "seed": ended["seed"], "commit": ended.get("commit"), "wall_seconds": ended["wall_seconds"], "steps": steps,
        "crashed": crashed,
        "crash_reason": ended["output_tail"] if crashed else "",
        "recoveries": recoveries, "lost": got.get("samples_lost", 0),
        "duplicated": got.get("duplicates_detected", 0) + len(twice), "steps_trained_twice": twice,
        "samples_too_long": got.get("samples_too_long", 0), "seconds_lost": parsed["lost"],
        "ranks_left_after_s": parsed["ranks_left_after_s"], "plans": parsed["plans"],
        "step_seconds": parsed["step_seconds"], "mean_reward_last": got.get("mean_reward_last"),
    }


def aggregate(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    # one figure per retried step (its lost seconds over the recoveries in it): the recoveries of one step share it
    lost = [r["seconds_per_recovery"] for run in runs for r in run["seconds_lost"]]
    times = [r["step_times_per_recovery"] for run in runs for r in run["seconds_lost"]
             if r["step_times_per_recovery"] is not None]
    plans = [[f"{p['plan']}/{p['micro_batch_tokens']}" for p in run["plans"]] for run in runs]
    return {
        "crashes": sum(r["crashed"] for r in runs),
        "recoveries": sum(len(r["recoveries"]) for r in runs),
        "lost": sum(r["lost"] for r in runs),
        "duplicated": sum(r["duplicated"] for r in runs),
        "seconds_lost_per_recovery": lost,
        "seconds_lost_per_recovery_ci95": mean_ci95(lost) if len(lost) > 1 else None,
        "recovery_in_step_times": times,
        "recovery_in_step_times_max": max(times) if times else None,
        "goal_met": (not any(r["crashed"] for r in runs) and not any(r["lost"] or r["duplicated"] for r in runs)
                     and bool(times) and max(times) < 2.0),
        "plans": plans,
        "repeats": len(runs),
        "runs": runs,
        "settings": {"config": str(CONFIG.relative_to(ROOT)), "memory_model_scale": args.scale, "steps": args.steps,
                     "rank_cap_bytes": budget_bytes(), "cap": "setrlimit(RLIMIT_DATA) per trainer rank",
                     "ranks": 2, "overrides": args.set},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where the result goes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="trainer steps per run (2 per context level: 4 levels)")
    ap.add_argument("--scale", type=float, default=0.5, help="selector.memory_model_scale: the deliberate error")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-minutes", type=float, default=60, help="a run still going after this long is killed")
    ap.add_argument("--set", action="append", default=[], help="more `up` overrides, KEY=VALUE")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="where the runs' directories go")
    ap.add_argument("--reparse", action="store_true", help="rebuild the result from the run directories under --out "
                    "(their bench_run.json) instead of running")
    args = ap.parse_args()
    if args.reparse:
        dirs = sorted(Path(args.out).glob("oom_recovery_*/bench_run.json"))
        runs = [collect(d.parent, json.loads(d.read_text()), args.steps) for d in dirs]
        result = aggregate(runs, args)
        write_result(args.json, result)
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
        return
    if not (model_dir() / "config.json").exists():
        raise SystemExit(f"{model_dir()} has no model: run `make real-model` first")
    out = Path(args.out)
    runs = []
    for k in range(args.repeats):
        runs.append(run_once(args, k, out))
        r = runs[-1]
        print(f"repeat {k + 1}/{args.repeats}: {r['steps']} steps in {r['wall_seconds']} s, crashed={r['crashed']}, "
              f"{len(r['recoveries'])} recoveries, lost {r['lost']}, duplicated {r['duplicated']}, seconds lost "
              f"{[x['seconds'] for x in r['seconds_lost']]}", flush=True)
        result = aggregate(runs, args)  # written after every repeat: a stopped campaign keeps what it measured
        write_result(args.json, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
