"""Chaos: the embedded default trains under `up --restart` while a seeded schedule kill -9s its processes.

    python bench/chaos.py --minutes 10 --json bench/results/chaos.json [--seed S] [--steps N] [overrides...]

For `--minutes` (default 10) a seeded schedule (exponential gaps, at least --kills kills, default 12)
sends SIGKILL to, in turn, a rollout worker, a trainer rank and the supervisor of a live `earl-stream up
--restart 1000 --steps N` (N default: 35 per minute, what the default trains on 2 cores undisturbed).
`up` starts a dead rollout worker or supervisor again (the supervisor from its write-ahead state on its
address), the trainer pool restarts a dead rank from its latest checkpoint. After the window the run
finishes its steps undisturbed. A kill is skipped (and retried at the next time) while the process it
would hit is not up yet. JSON keys: `kills` (list: time, role, pid), `samples_produced`,
`samples_consumed`, `samples_lost`, `prompts_reissued`, `duplicates_detected`, `steps`,
`final_win_rate`, plus `finished` (`up` exited 0 with every step done), `lost_prompts_reissued`
(every group with lost samples was played again: prompts_reissued >= groups lost) and `reached_target`.
Goals: duplicates 0, every lost sample's prompt re-issued, all steps done, the win rate reaches the
default's target (--target, 0.85).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from live_up import LiveUp  # noqa: E402  (bench/, beside this script)

from bench.provenance import write_result  # noqa: E402
from earl_stream.config import load_config  # noqa: E402

ROLES = ("rollout", "trainer", "supervisor")
STEPS_PER_MINUTE = 35


def _victim(role: str, status: dict[str, Any], supervisor_pid: int | None) -> int | None:
    if role == "supervisor":
        return supervisor_pid
    alive = [w for w in status["workers"] if w["alive"] and w["role"] == role and w["pid"]]
    return alive[0]["pid"] if alive else None


def _supervisor_pid(run: Path) -> int | None:
    """The pid of the supervisor `up` started (its command line names this run's ready file)."""
    ready = str(run / "supervisor.json")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"supervisor" in cmd and ready.encode() in cmd:
                return int(entry.name)
    return None


def schedule(minutes: float, kills: int, seed: int) -> list[float]:
    """Kill times (seconds from the first step): exponential gaps with `kills` expected in the window."""
    rng = random.Random(seed)
    window = minutes * 60
    times: list[float] = []
    t = 0.0
    while len(times) < kills or t < window:
        t += rng.expovariate(kills / window)
        if t >= window and len(times) >= kills:
            break
        times.append(min(t, window))
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="the window in which kills happen")
    ap.add_argument("--kills", type=int, default=12, help="at least this many kills in the window")
    ap.add_argument("--steps", type=int, default=0, help="steps of the run (0: 35 per minute of the window)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.85, help="win rate the default reaches undisturbed")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for the run")
    args = ap.parse_args()
    steps = args.steps or int(STEPS_PER_MINUTE * args.minutes)
    times = schedule(args.minutes, args.kills, args.seed)
    kills: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="earl-chaos-") as tmp:
        run, summary = Path(tmp) / "run", Path(tmp) / "summary.json"
        up = LiveUp(run, "--restart", "1000", "--steps", str(steps), "--summary", str(summary),
                    "trainer.checkpoint_every=5", "supervisor.lease_s=10", *args.overrides, log=Path(tmp) / "up.log")
        try:
            started = None
            while up.proc.poll() is None and started is None:
                s = up.status(5)
                started = time.monotonic() if s and s["policy_version"] >= 1 else None
                time.sleep(0.5)
            for i, at in enumerate(times):
                role = ROLES[i % len(ROLES)]
                while up.proc.poll() is None and started is not None and time.monotonic() - started < at:
                    time.sleep(0.2)
                pid = None
                while up.proc.poll() is None and pid is None:  # the process it would hit may still be coming back
                    s = up.status(5)
                    pid = _victim(role, s, _supervisor_pid(run)) if s else None
                    if pid is None:
                        time.sleep(0.5)
                if pid is None:
                    break
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                version = (s or {}).get("policy_version")
                kills.append({"t_s": round(time.monotonic() - (started or 0), 1), "role": role, "pid": pid,
                              "policy_version": version})
                print(f"chaos: kill -9 {role} (pid {pid}) at {kills[-1]['t_s']}s, version {version}", flush=True)
            code = up.proc.wait(timeout=steps * 60)
        finally:
            up.stop()
        s = json.loads(summary.read_text()) if summary.exists() else {}
        tail = (Path(tmp) / "up.log").read_text(errors="replace")[-3000:]
        group_size = load_config(str(run / "config.yaml")).trainer.group_size
    lost_groups = -(-s.get("samples_lost", 0) // group_size)  # at least this many groups lost samples
    result = {
        "kills": kills, "kills_by_role": {r: sum(k["role"] == r for k in kills) for r in ROLES},
        "samples_produced": s.get("samples_produced"), "samples_consumed": s.get("samples_trained"),
        "samples_lost": s.get("samples_lost"), "prompts_reissued": s.get("prompts_reissued"),
        "duplicates_detected": s.get("duplicates_detected"), "steps": s.get("policy_version"),
        "steps_asked": steps, "final_win_rate": s.get("win_rate_last"),
        "finished": code == 0 and s.get("policy_version", 0) >= steps,
        "lost_prompts_reissued": s.get("prompts_reissued", 0) >= lost_groups,
        "reached_target": (s.get("win_rate_last") or 0) >= args.target, "target": args.target,
        "wall_seconds": s.get("wall_seconds"), "minutes": args.minutes, "seed": args.seed,
    }
    if code != 0:
        result["up_log_tail"] = tail
    print(json.dumps({k: v for k, v in result.items() if k != "kills"}, indent=1))
    if args.json:
        write_result(Path(args.json), result, indent=1)
    ok = result["finished"] and result["duplicates_detected"] == 0 and result["lost_prompts_reissued"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
