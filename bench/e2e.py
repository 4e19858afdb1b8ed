"""End-to-end benchmark: earl_stream asynchronous vs earl_stream synchronous vs TRL's GRPOTrainer,
on the same tiny model, the same game (Tic-Tac-Toe as X against a seeded random opponent), the same
GRPO hyper-parameters (estimator, group size, no KL term) and the same machine.

    python bench/e2e.py --json bench/results/e2e.json [--part comparison|staleness|all] [--repeats 3]
    python bench/e2e.py --quick ...     # one repeat, 60 s a run, staleness 0 and 1: checks, not results

Part `comparison` (`--repeats` per arm, arms interleaved: async, sync, trl, async, ...; `--seconds` each,
measured after its first step):
- **async**: `earl-stream up` (real processes) at the default staleness bound (1), disaggregated: the
  rollout pool pinned to CPU 0 and the trainer pool to CPU 1, one torch thread each;
- **sync**: the same with `trainer.max_staleness=0` (generate, train, generate), and every phase gets all
  the cores: neither pool pinned, `--sync-threads` torch threads each (only one of them works at a time);
- **trl**: `trl.GRPOTrainer` in a child process (from `.venv-bench` if this interpreter lacks trl), not
  pinned, `--trl-threads` torch threads.
The sync and TRL arms are tuned first as a careful user would: unless their thread counts are given, each runs
`--probe-seconds` with 1 torch thread and with one per CPU, and the faster is kept (`thread_probes`).
Keys: `async_vs_ceiling` {mean, low, high, n}: each async run's steps/s over the ceiling its own pools allow
(with one core each a step takes at least the larger of the two pools' CPU seconds per step);
`async_vs_sync` (samples/s, ratio of means with its 95% interval); `loss_tokens_per_s` per system (tokens
that receive gradient: earl_stream's trainer log, TRL's trained completion tokens), mean [95%];
`time_to_target_vs_trl` {default_model: earl_stream async's seconds to the target win rate over TRL's, ratio
of means with its interval, null when a side never reached it; smollm2: part `smollm2`'s}.

Part `smollm2` (bench/e2e_smollm2.py): SmolLM2-135M-Instruct on configs/smollm2_arithmetic.yaml's task, earl_stream
against TRL training every weight, `--seeds` seeds each, time to +10 points of held-out success and loss tokens/s.

Part `staleness`: `trainer.max_staleness` in `--staleness` (0, 1, 2, 4, 8) x `--seeds` seeds (the config's
`seed`), interleaved seed by seed, pinned as async, `--ablation-seconds` after the first step each: the
seconds from launch to a `--target` win rate (last 256 games; null when not reached) and the final win rate.
Key `staleness_ablation` {k: {seconds_to_target: [per seed], final_win_rate: [per seed]}}. `--resume` keeps the
runs the file already holds and runs the missing ones (the ablation can span sessions).
One part run alone keeps the other part's keys from the file it replaces (`part_wall_seconds` says each part's).

TRL is single-turn: its arm (bench/e2e_trl.py, a child process) trains each game's first move and plays the
rest of the game inside the reward function, so a TRL "sample" is one full game of which only the first move is
trained.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from e2e_smollm2 import add_arguments as add_smollm2_arguments
from e2e_smollm2 import run_part as run_smollm2
from pipeline_rates import HEARTBEAT_S, LOAD_LINE, MODE_OVERRIDES, PINNED_POOLS, Snapshot, Watch, log_window, trainer_steps, watch_up
from provenance import keep_parts, scrub, write_result
from stats import interval, ratio_interval

ROOT = Path(__file__).resolve().parent.parent
GROUP_SIZE, GROUPS_PER_STEP, LR, SEED, WINDOW = 8, 8, 1e-3, 0, 256
CORES: dict[str, dict[str, str]] = {
    "async": {"rollout": "CPU 0, 1 thread", "trainer": "CPU 1, 1 thread", "supervisor": "not pinned"},
    "sync": {"rollout": "all CPUs, 2 threads", "trainer": "all CPUs, 2 threads", "supervisor": "not pinned"},
    "trl": {"everything": "all CPUs (not pinned)"}}
# sync: each phase alone on the machine, so each gets every core (the pools take turns); --sync-threads sets them
def all_cores(threads: int) -> list[str]:
    return ["rollout.workers=1", f"rollout.threads={threads}", f"trainer.threads={threads}",
            f"supervisor.heartbeat_s={HEARTBEAT_S}"]


# ----------------------------------------------------------------------------------- earl_stream

def run_earl(mode: str, model_dir: Path, seconds: float, target: float, work: Path, *, seed: int = SEED,
             staleness: int | None = None, tag: str = "", sync_threads: int = 2) -> dict[str, Any]:
    """One `earl-stream up` run for `seconds` after its first step; returns throughput, curve, profile.
    `mode` async (pinned pools) or sync (all cores to each phase); `staleness` overrides trainer.max_staleness."""
    run_dir = work / f"earl_{tag or mode}"
    pools = all_cores(sync_threads) if mode == "sync" else PINNED_POOLS
    extra = [] if staleness is None else [f"trainer.max_staleness={staleness}"]
    overrides = [f"model.path={model_dir}", f"run_dir={run_dir}", f"seed={seed}", *pools,
                 f"trainer.group_size={GROUP_SIZE}", f"trainer.groups_per_step={GROUPS_PER_STEP}", f"trainer.lr={LR}",
                 f"supervisor.stats_window={WINDOW}",
                 # TRL GRPOTrainer's objective: no entropy bonus, constant lr, one opponent per group (defaults moved)
                 "algo.entropy_coef=0", "algo.lr_schedule=constant", "envs.0.group_seed=shared", *MODE_OVERRIDES[mode],
                 *extra]
    watch = watch_up(["--summary", str(run_dir / "summary.json"), *overrides], run_dir,
                     lambda now, first: first is not None and now.t - first.t >= seconds, what=mode)
    result = _earl_result(mode, watch, run_dir, target)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the numbers are what is kept
    return {**result, "seed": seed, "max_staleness": 0 if mode == "sync" else 1 if staleness is None else staleness}


def _earl_point(snap: Snapshot) -> dict[str, Any]:
    s = snap.status
    gen = sum(int(w.get("stats", {}).get("tokens", 0)) for w in s.get("workers", []) if w["role"] == "rollout")
    return {"t": snap.t, "step": snap.step, "samples_trained": s["samples_consumed"],
            "samples_produced": s["samples_produced"], "generated_tokens": gen, "win": s.get("win_rate_last"),
            "draw": s.get("draw_rate_last"), "stale": s.get("samples_stale", 0)}


def _earl_result(mode: str, watch: Watch, run_dir: Path, target: float) -> dict[str, Any]:
    assert watch.first is not None
    first, last = watch.first, watch.snapshots[-1]
    curve = [_earl_point(snap) for snap in watch.snapshots]
    t0, t1 = _earl_point(first), _earl_point(last)
    dt = t1["t"] - t0["t"]
    steps = [x for x in trainer_steps(run_dir / "logs" / "trainer.log").values() if first.wall <= x.when <= last.wall]
    loads = log_window(run_dir / "logs" / "rollout-0.log", LOAD_LINE, first.wall, last.wall)
    step_s = sum(x.seconds for x in steps)
    pull_s = sum(x.pull_seconds for x in steps)
    trained_tokens = sum(x.tokens for x in steps)
    samples = sum(x.samples for x in steps)
    loss_tokens = sum(x.loss_tokens or 0 for x in steps) if all(x.loss_tokens is not None for x in steps) else None
    cpu = {role: round((last.cpu.get(role, 0.0) - first.cpu.get(role, 0.0)) / dt, 3) for role in last.cpu}
    reached = next((p for p in curve if p["win"] is not None and p["win"] >= target), None)
    return {
        "system": f"earl_stream {mode}", "window_s": round(dt, 1), "steps": t1["step"] - t0["step"],
        "samples_per_s": samples / dt,  # from the trainer's log: what it really trained
        "produced_samples_per_s": (t1["samples_produced"] - t0["samples_produced"]) / dt,
        "generated_tokens_per_s": (t1["generated_tokens"] - t0["generated_tokens"]) / dt,
        "trained_tokens_per_s": trained_tokens / dt,
        "loss_tokens_per_s": loss_tokens / dt if loss_tokens is not None else None,
        "steps_per_s": (t1["step"] - t0["step"]) / dt,
        "startup_s": t0["t"], "time_to_target_s": reached["t"] if reached else None,
        "start_win_rate": next((p["win"] for p in curve if p["win"] is not None), None),
        "final_win_rate": curve[-1]["win"] if curve else None,
        "samples_stale": t1["stale"] - t0["stale"],
        "cpu_seconds_per_sample": sum(cpu.values()) * dt / max(1, samples),
        "cpu_seconds_per_step": {role: round(u * dt / max(1, len(steps)), 3) for role, u in cpu.items()},
        "profile": {
            "cpu_utilisation": cpu,
            "trainer_train_fraction": round((step_s - pull_s) / dt, 3),
            "trainer_pull_fraction": round(pull_s / dt, 3),
            "trainer_waiting_fraction": round(1 - step_s / dt, 3),
            "trainer_step_s_mean": round(step_s / max(1, len(steps)), 3),
            "rollout_weight_load_fraction": round(sum(float(r[0]) for r in loads) / dt, 3),
            "rollout_idle_fraction": round(1 - cpu.get("rollout", 0.0), 3),
            "note": "fractions of the measured window; trainer waiting = claiming (waiting for samples) + "
                    "publishing weights; rollout idle = 1 - its CPU utilisation (waiting for weights or prompts)",
        },
        "curve": curve,
    }


# ------------------------------------------------------------------------------------------ TRL

def run_trl(model_dir: Path, seconds: float, target: float, work: Path, threads: int, seed: int = SEED) -> dict[str, Any]:
    """TRL in a child process (its own interpreter: `.venv-bench` when this one has no trl)."""
    python = sys.executable
    probe = subprocess.run([python, "-c", "import trl"], capture_output=True, cwd=work)
    if probe.returncode != 0 and (ROOT / ".venv-bench" / "bin" / "python").exists():
        python = str(ROOT / ".venv-bench" / "bin" / "python")
    out = work / f"trl_seed{seed}.json"
    cmd = [python, str(Path(__file__).resolve().with_name("e2e_trl.py")), "--model", str(model_dir),
           "--seconds", str(seconds), "--target", str(target), "--json", str(out), "--threads", str(threads),
           "--seed", str(seed), "--group-size", str(GROUP_SIZE), "--groups-per-step", str(GROUPS_PER_STEP),
           "--lr", str(LR), "--window", str(WINDOW)]
    # cwd=work: a folder named `vllm` in the working directory breaks `import trl`
    proc = subprocess.run(cmd, cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"system": "trl", "seed": seed, "error": proc.stderr[-3000:]}
    return {**json.loads(out.read_text()), "seed": seed}


# ----------------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/e2e.json", help="where to write the results")
    ap.add_argument("--part", choices=("comparison", "staleness", "smollm2", "all"), default="all",
                    help="which campaign: async vs sync vs TRL, the staleness ablation, SmolLM2 against TRL "
                         "(bench/e2e_smollm2.py), or all three (~1 h each here)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per arm of the comparison (interleaved)")
    ap.add_argument("--seconds", type=float, default=200.0, help="measured seconds per comparison run (after its first step)")
    ap.add_argument("--only", default="async,sync,trl", help="arms of the comparison to run")
    ap.add_argument("--staleness", default="0,1,2,4,8", help="trainer.max_staleness values of the ablation")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per staleness value")
    ap.add_argument("--ablation-seconds", type=float, default=240.0,
                    help="seconds per ablation run after its first step (the default model first reaches 0.9 at "
                         "~240 s from launch: bench/results/learning.json)")
    ap.add_argument("--target", type=float, default=0.9, help="win rate (last 256 games) to report the time to")
    ap.add_argument("--model", default="", help="model directory; default: the embedded default model")
    ap.add_argument("--trl-threads", type=int, default=0,
                    help="TRL's torch threads (0 = probe 1 and one per CPU, keep the faster: the same cores either way)")
    ap.add_argument("--sync-threads", type=int, default=0,
                    help="torch threads of each pool in the sync arm (0 = probe 1 and one per CPU for --probe-seconds "
                         "each and keep the faster, as a careful user would)")
    ap.add_argument("--probe-seconds", type=float, default=60.0,
                    help="measured seconds of each thread-count probe of the sync and TRL arms")
    ap.add_argument("--resume", action="store_true",
                    help="staleness part: keep the (max_staleness, seed) runs the --json file already holds (same "
                         "--ablation-seconds and target) and run only the missing ones, e.g. --seeds 1 in one "
                         "session and --seeds 3 --resume in the next")
    add_smollm2_arguments(ap)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 60 s a run, 30 s probes, staleness 0 and 1, 1 seed; "
                                                         "smollm2: 4 min a run, 50 problems")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.seconds, args.ablation_seconds, args.seeds, args.probe_seconds = 1, 60.0, 60.0, 1, 30.0
        args.staleness = "0,1"
        args.smollm2_minutes, args.smollm2_problems = 4.0, 50
    args.smollm2_work = args.smollm2_work or ("runs/e2e_smollm2_quick" if args.quick else "runs/e2e_smollm2")
    arms = [a for a in args.only.split(",") if a]
    if unknown := set(arms) - {"async", "sync", "trl"}:
        ap.error(f"--only: unknown {sorted(unknown)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from earl_stream.model import ensure_default_model

    model_dir = Path(args.model) if args.model else ensure_default_model()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="earl-e2e-"))
    probes: dict[str, Any] = {}
    if args.part in ("comparison", "all"):
        probes = probe_threads(arms, args, model_dir, work)
    trl_threads = args.trl_threads or probes.get("trl", {}).get("chosen") or len(os.sched_getaffinity(0))
    sync_threads = args.sync_threads or probes.get("sync", {}).get("chosen") or len(os.sched_getaffinity(0))
    CORES["sync"] = {"rollout": f"all CPUs, {sync_threads} thread(s)", "trainer": f"all CPUs, {sync_threads} thread(s)",
                     "supervisor": "not pinned"}
    CORES["trl"]["everything"] = f"all CPUs (not pinned), {trl_threads} torch thread(s)"
    result: dict[str, Any] = {
        "quick": args.quick, "model": str(model_dir), "group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP,
        "lr": LR, "samples_per_step": GROUP_SIZE * GROUPS_PER_STEP, "stats_window_games": WINDOW,
        "target_win_rate": args.target, "core_assignment": CORES,
        "sample_definition": {"earl_stream": "one full multi-turn game; every model token is trained (a loss token)",
                              "trl": "one full game; only the first move is trained (TRL is single-turn)"},
        "machine": {"cpus": os.cpu_count(), "load_avg_before": os.getloadavg()}}
    started = time.time()
    if args.part in ("comparison", "all"):
        runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
        for k in range(args.repeats):
            for arm in arms:
                print(f"comparison: {arm}, repeat {k + 1} of {args.repeats} ...", flush=True)
                run = (run_trl(model_dir, args.seconds, args.target, work, trl_threads, seed=SEED + k) if arm == "trl"
                       else run_earl(arm, model_dir, args.seconds, args.target, work, seed=SEED + k, tag=f"{arm}{k}",
                                     sync_threads=sync_threads))
                run["load_avg_after"] = os.getloadavg()
                runs[arm].append(run)
                print(json.dumps({x: v for x, v in run.items() if x not in ("curve", "profile")}, default=str)[:1500],
                      flush=True)
        result.update(seconds_per_run=args.seconds, repeats=args.repeats, runs=runs, thread_probes=probes,
                      **summarise_comparison(runs))
    if args.part in ("staleness", "all"):
        values = [int(v) for v in args.staleness.split(",") if v]
        ablation: dict[str, list[dict[str, Any]]] = {str(v): [] for v in values}
        kept = kept_ablation_runs(json.loads(out.read_text()), args.ablation_seconds, args.target) \
            if args.resume and out.exists() else {}
        for seed in range(args.seeds):
            for v in values:
                if (str(v), SEED + seed) in kept:
                    print(f"staleness ablation: max_staleness={v}, seed {seed}: kept from {out}", flush=True)
                    ablation[str(v)].append(kept[(str(v), SEED + seed)])
                    continue
                print(f"staleness ablation: max_staleness={v}, seed {seed} ...", flush=True)
                run = run_earl("async", model_dir, args.ablation_seconds, args.target, work, seed=SEED + seed,
                               staleness=v, tag=f"stale{v}_seed{seed}")
                ablation[str(v)].append({x: run[x] for x in ("seed", "max_staleness", "time_to_target_s",
                                                             "final_win_rate", "samples_per_s", "loss_tokens_per_s",
                                                             "samples_stale", "startup_s", "window_s")})
        result.update(ablation_seconds=args.ablation_seconds, staleness_ablation=summarise_staleness(ablation))
    if args.part in ("smollm2", "all"):
        from real_model import model_dir as smollm2_dir

        result["smollm2"] = run_smollm2(args, smollm2_dir())
    result["machine"].update(load_avg_after=os.getloadavg(), note="shared machine: other jobs may run alongside "
                             "(each run's load_avg_after)")
    result["wall_seconds"] = round(time.time() - started, 1)
    result["part_wall_seconds"] = {args.part: result["wall_seconds"]}
    if args.part != "all" and out.exists():
        result = keep_other_part(json.loads(out.read_text()), result, args.part)
    result = with_smollm2_ratio(result)
    write_result(out, result)
    if result.get("runs"):
        plot(result["runs"], out.with_suffix(".png"), args.target)
    print_table(result)
    return 0


COMPARISON_KEYS = ("seconds_per_run", "repeats", "runs", "thread_probes", "async_vs_ceiling", "async_vs_ceiling_per_run", "async_vs_sync",
                   "async_vs_trl", "samples_per_s", "loss_tokens_per_s", "time_to_target_vs_trl", "time_to_target_s",
                   "failed_runs", "notes")
STALENESS_KEYS = ("ablation_seconds", "staleness_ablation")
PARTS = {"comparison": COMPARISON_KEYS, "staleness": STALENESS_KEYS, "smollm2": ("smollm2",)}


def probe_threads(arms: list[str], args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    """The baselines tuned as a careful user would: the sync and TRL arms whose thread count is not given run once
    for `--probe-seconds` with 1 torch thread and with one per CPU; the faster (samples/s) is kept for the campaign.
    {arm: {samples_per_s: {threads: rate or null (failed)}, chosen}}."""
    counts = sorted({1, len(os.sched_getaffinity(0))})
    out: dict[str, Any] = {}
    for arm, given in (("sync", args.sync_threads), ("trl", args.trl_threads)):
        if arm not in arms or given or len(counts) < 2:
            continue
        rates: dict[int, float | None] = {}
        for threads in counts:
            print(f"thread probe: {arm} with {threads} torch thread(s), {args.probe_seconds:.0f} s ...", flush=True)
            run = (run_trl(model_dir, args.probe_seconds, args.target, work, threads, seed=SEED) if arm == "trl"
                   else run_earl("sync", model_dir, args.probe_seconds, args.target, work, tag=f"probe_sync{threads}",
                                 sync_threads=threads))
            rates[threads] = None if "error" in run else run["samples_per_s"]
        out[arm] = {"samples_per_s": {str(t): r for t, r in rates.items()}, "chosen": fastest_threads(rates),
                    "probe_seconds": args.probe_seconds}
        print(f"thread probe: {arm} keeps {out[arm]['chosen']} thread(s): {out[arm]['samples_per_s']}", flush=True)
    return out


def fastest_threads(rates: dict[int, float | None]) -> int:
    """The thread count with the highest rate; the fewest threads among equals, and when every probe failed."""
    ok = {t: r for t, r in rates.items() if r is not None}
    if not ok:
        return min(rates)
    best = max(ok.values())
    return min(t for t, r in ok.items() if r == best)


def kept_ablation_runs(previous: dict[str, Any], seconds: float, target: float) -> dict[tuple[str, int], dict[str, Any]]:
    """The staleness runs a previous file holds, by (max_staleness, seed), for `--resume`; a file measured with
    other run lengths or another target is refused (its runs would not be comparable)."""
    ablation = previous.get("staleness_ablation") or {}
    if not ablation:
        return {}
    if (previous.get("ablation_seconds"), previous.get("target_win_rate")) != (seconds, target):
        raise SystemExit(f"e2e: --resume: the file's ablation ran {previous.get('ablation_seconds')} s to "
                         f"{previous.get('target_win_rate')}, not {seconds} s to {target}: run without --resume")
    return {(value, int(r["seed"])): r for value, summary in ablation.items() for r in summary.get("runs", [])}


def keep_other_part(previous: dict[str, Any], result: dict[str, Any], part: str) -> dict[str, Any]:
    """`result` of one part with the other parts' keys kept from `previous` (the file it replaces), so the
    campaigns (an hour each) can run apart. A previous file of another format (no key of another part) is replaced
    whole; one measured on another model or target keeps only its `smollm2` part (its own model and target)."""
    others = {k: v for k, v in PARTS.items() if k != part}
    if not any(k in previous for k in ("async_vs_ceiling", "staleness_ablation", "smollm2")):
        return result
    if (previous.get("model"), previous.get("target_win_rate")) != (scrub(result.get("model")),
                                                                     result.get("target_win_rate")):
        print(f"e2e: {part}: the previous file measured another model or target; its default-model parts are dropped",
              flush=True)
        others = {k: v for k, v in others.items() if k == "smollm2"}
    if not any(k in previous for keys in others.values() for k in keys):
        return result
    merged = keep_parts(previous, result, others)  # each kept part keeps the provenance it was measured at
    merged["part_wall_seconds"] = {**(previous.get("part_wall_seconds") or {}), **result["part_wall_seconds"]}
    return with_smollm2_ratio(merged)


def with_smollm2_ratio(result: dict[str, Any]) -> dict[str, Any]:
    """`time_to_target_vs_trl.smollm2` from the `smollm2` part, whichever part ran last (a comparison part kept
    from a file written before part smollm2 existed loses its note that the ratio is not measured)."""
    to_target = dict(result.get("time_to_target_vs_trl") or {"default_model": None})
    to_target["smollm2"] = (result.get("smollm2") or {}).get("time_to_target_vs_trl")
    notes = result.get("notes")
    if result.get("smollm2") and notes:
        notes = [n for n in notes if not n.startswith("time_to_target_vs_trl.smollm2")]
    return {**result, "time_to_target_vs_trl": to_target, **({"notes": notes} if notes is not None else {})}


def summarise_comparison(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """From the comparison's recorded runs: `async_vs_ceiling`, `async_vs_sync`, `loss_tokens_per_s` per system,
    `time_to_target_vs_trl`, with notes on what they cannot say."""
    ok = {arm: [r for r in rs if "error" not in r] for arm, rs in runs.items()}
    ceiling = []
    for r in ok.get("async", []):
        per_step = r.get("cpu_seconds_per_step") or {}
        if per_step.get("rollout") and per_step.get("trainer"):
            # one core per pool: a step takes at least the larger pool's CPU seconds
            ceiling.append(r["steps_per_s"] * max(per_step["rollout"], per_step["trainer"]))
    rate = {arm: [r["samples_per_s"] for r in rs] for arm, rs in ok.items()}
    loss = {arm: [r["loss_tokens_per_s"] for r in rs if r.get("loss_tokens_per_s")] for arm, rs in ok.items()}
    reached = {arm: [r["time_to_target_s"] for r in rs] for arm, rs in ok.items()}
    notes = []
    to_target = None
    if reached.get("async") and reached.get("trl"):
        if all(t is not None for t in reached["async"] + reached["trl"]):
            to_target = ratio_interval(reached["async"], reached["trl"])
        elif None not in reached["async"] and all(t is None for t in reached["trl"]):
            # TRL never got there: each run's time is at least its length (launch to end), so the ratio of means is
            # at most async's mean over the runs' mean length
            spans = [r["startup_s"] + r["window_s"] for r in ok["trl"]]
            to_target = {"mean": None, "at_most": (sum(reached["async"]) / len(reached["async"])) / (sum(spans) / len(spans)),
                         "n": len(reached["async"]), "trl_reached": False}
            notes.append(f"time_to_target_vs_trl.default_model: no TRL run reached the target within {min(spans):.0f} s "
                         "from launch; every async run did: `at_most` bounds the ratio (async's mean over TRL's mean run)")
        else:
            notes.append("time_to_target_vs_trl.default_model is null: a run did not reach the target within its "
                         f"window (async {reached['async']}, trl {reached['trl']} seconds)")
    return {
        "async_vs_ceiling": interval(ceiling), "async_vs_ceiling_per_run": ceiling,
        "async_vs_sync": ratio_interval(rate.get("async", []), rate.get("sync", [])),
        "async_vs_trl": ratio_interval(rate.get("async", []), rate.get("trl", [])),
        "samples_per_s": {arm: interval(v) for arm, v in rate.items()},
        "loss_tokens_per_s": {arm: interval(v) for arm, v in loss.items()},
        "time_to_target_vs_trl": {"default_model": to_target, "smollm2": None},
        "time_to_target_s": reached, "failed_runs": {arm: len(runs[arm]) - len(ok[arm]) for arm in runs},
        "notes": notes,
    }


def summarise_staleness(ablation: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per max_staleness: seconds to the target per seed (null: not reached), final win rate per seed, their
    means [95%] where every seed has one."""
    out = {}
    for value, rs in ablation.items():
        times, finals = [r["time_to_target_s"] for r in rs], [r["final_win_rate"] for r in rs]
        out[value] = {"seconds_to_target": times, "final_win_rate": finals,
                      "seconds_to_target_mean": interval(times) if times and None not in times else None,
                      "final_win_rate_mean": interval([f for f in finals if f is not None]), "runs": rs}
    return out


def print_table(result: dict[str, Any]) -> None:
    def ci(x: dict[str, Any] | None) -> str:
        if not x:
            return "n/a"
        if x.get("mean") is None:
            return f"<= {x['at_most']:.2f}" if x.get("at_most") is not None else "n/a"
        lo, hi = x.get("ci95") or [x.get("low"), x.get("high")]
        return f"{x['mean']:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None else "")

    for arm, probe in (result.get("thread_probes") or {}).items():
        print(f"{arm} thread probe (samples/s by torch threads): {probe['samples_per_s']}; kept {probe['chosen']}")
    if result.get("runs"):
        print(f"\n{'system':<10} {'samples/s':>24} {'loss tok/s':>24}  seconds to {result['target_win_rate']}")
        for arm in result["runs"]:
            print(f"{arm:<10} {ci(result['samples_per_s'].get(arm)):>24} {ci(result['loss_tokens_per_s'].get(arm)):>24}  "
                  f"{result['time_to_target_s'].get(arm)}")
        print(f"async / ceiling {ci(result['async_vs_ceiling'])}; async / sync {ci(result['async_vs_sync'])}; "
              f"async / TRL {ci(result['async_vs_trl'])}; time to target vs TRL "
              f"{ci(result['time_to_target_vs_trl']['default_model'])}")
    for value, r in (result.get("staleness_ablation") or {}).items():
        print(f"max_staleness {value}: seconds to {result['target_win_rate']} {r['seconds_to_target']}, "
              f"final win rate {r['final_win_rate']}")


def plot(runs: dict[str, list[dict[str, Any]]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"async": "tab:blue", "sync": "tab:orange", "trl": "tab:green"}
    for arm, rs in runs.items():
        for k, r in enumerate(rs):
            pts = [p for p in r.get("curve", []) if p.get("win") is not None]
            if pts:
                ax.plot([p["t"] for p in pts], [p["win"] for p in pts], color=colours.get(arm), alpha=0.8,
                        label=r.get("system", arm) if k == 0 else None)
    ax.axhline(target, ls="--", c="grey", label=f"target {target}")
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel(f"win rate (last {WINDOW} games)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Tic-Tac-Toe vs random: earl_stream async / sync vs TRL (each repeat)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
