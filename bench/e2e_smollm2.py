"""bench/e2e.py's part `smollm2`: SmolLM2-135M-Instruct learning three-term addition, earl_stream against TRL's
GRPOTrainer, in time to a held-out target and in loss tokens per second.

    python bench/e2e.py --part smollm2 [--seeds 3] [--smollm2-minutes 10] [--smollm2-work DIR] [--smollm2-stage all]

Arms, interleaved seed by seed (`--seeds`, the config's `seed` and TRL's), each given `--smollm2-minutes` of wall
time from launch (start-up included):
- **earl_stream**: `earl-stream up --config configs/smollm2_arithmetic.yaml` as shipped (rollout pool on CPU 0,
  trainer on CPU 1, dynamic sampling on), a checkpoint every `--save-every` steps;
- **trl**: `trl.GRPOTrainer` (bench/lora_trl.py `--full`, a child in `.venv-bench`) with the same config's model,
  task, scorer, learning rate, group size, groups per step, temperature, reply length and no KL term, every
  weight trained, on both CPUs (2 torch threads, torch's default here), the model saved every `--save-every` steps.
  TRL has no dynamic sampling: groups of equal rewards stay in its batches with zero advantage.
A checkpoint's time is the end of the step it holds, in seconds from launch; only those within the budget count.

Stage `eval` (it needs no quiet machine: greedy success does not depend on timing) scores models on
bench/heldout.py's 200 held-out problems, which neither system trains on: the base, each run's last checkpoint
within the budget (`heldout_at_budget`), then each run's checkpoints in time order up to the first at or above the
target (the base's success + `--smollm2-gain`): its time is the run's `time_to_target_s` (null when none was);
`--smollm2-curves` scores the rest too. Evaluations are cached in WORK/evals.json and runs in WORK/runs.json, so
either stage resumes where it stopped.

Keys under `smollm2`: `runs` {earl_stream, trl: per seed}, `train_seconds` (the runs' wall time, launch to stop:
`part_wall_seconds` counts only the stage that wrote the file), `heldout_before`, `target_success`,
`heldout_at_budget` and `loss_tokens_per_s` per system (mean [95%]), `time_to_target_s` per system (per seed),
`time_to_target_vs_trl` (ratio of means with its interval; `at_most` when every earl_stream run reached the
target and no TRL run did: TRL's time is then past the budget), `notes`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stats import interval, ratio_interval

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2_arithmetic.yaml"
SYSTEMS = ("earl_stream", "trl")


def train_earl(model_dir: Path, seed: int, minutes: float, save_every: int, work: Path) -> dict[str, Any]:
    """One `up` run on CONFIG for `minutes` from launch; its steps, loss tokens/s and checkpoints (model only)."""
    from pipeline_rates import trainer_steps
    from real_model import train

    from earl_stream.workers.checkpoint import DCP_DIR

    run_dir = work / f"earl_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    budget = argparse.Namespace(steps=0, minutes=minutes, every=15.0,
                                overrides=[f"seed={seed}", f"trainer.checkpoint_every={save_every}"])
    launched = time.time()
    curve, status, wall = train(model_dir, run_dir, budget, CONFIG)
    logged = trainer_steps(run_dir / "logs" / "trainer.log")
    numbers = sorted(logged)
    window = logged[numbers[-1]].when - logged[numbers[0]].when if len(numbers) > 1 else 0.0
    loss = [logged[n].loss_tokens for n in numbers[1:]]
    checkpoints = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        shutil.rmtree(ckpt / DCP_DIR, ignore_errors=True)  # model and optimizer shards (~1.6 GB): the export stays
        step = int(ckpt.name.split("_")[1])
        if step in logged and (ckpt / "config.json").exists():
            checkpoints.append({"step": step, "t": round(logged[step].when - launched, 1), "path": str(ckpt)})
    return {"system": "earl_stream", "seed": seed, "steps": len(numbers), "wall_seconds": round(wall, 1),
            "startup_s": round(logged[numbers[0]].when - launched, 1) if numbers else None,
            "samples_trained": sum(s.samples for s in logged.values()),
            "loss_tokens_per_s": sum(x or 0 for x in loss) / window if window and None not in loss else None,
            "trained_tokens_per_s": sum(logged[n].tokens for n in numbers[1:]) / window if window else None,
            "checkpoints": checkpoints, "curve": curve,
            "config": str(CONFIG.relative_to(ROOT))}


def train_trl(model_dir: Path, seed: int, minutes: float, save_every: int, work: Path, threads: int) -> dict[str, Any]:
    """TRL's GRPOTrainer, every weight trained, for `minutes` from launch (bench/lora_trl.py --full)."""
    from lora_trl import run_trl

    trl_work = work / f"trl_seed{seed}"
    shutil.rmtree(trl_work, ignore_errors=True)
    trl_work.mkdir(parents=True)
    run = run_trl(str(model_dir), trl_work, threads, seed=seed, minutes=minutes, full=True, save_every=save_every)
    return {**run, "seed": seed, "config": str(CONFIG.relative_to(ROOT))}


def evaluate_runs(runs: dict[str, list[dict[str, Any]]], evals: dict[str, Any], base: str, budget_s: float,
                  gain: float, measure: Callable[[str], dict[str, Any]], save: Callable[[dict[str, Any]], None], *,
                  curves: bool = False) -> None:
    """Fill `evals` {model directory: `measure`'s held-out result}: the base, each run's last checkpoint within
    the budget, then each run's checkpoints in time order up to the first at or above the target (base + `gain`);
    `curves`: then every other checkpoint within the budget. Cached entries are not measured again;
    `save(evals)` after each (the stage resumes where it stopped)."""

    def score(path: str) -> dict[str, Any]:
        if path not in evals:
            print(f"smollm2: held-out evaluation of {path} ...", flush=True)
            evals[path] = measure(path)
            save(evals)
        return dict(evals[path])

    target = score(base)["success"] + gain - 1e-12
    plans = [c for c in (in_budget(run, budget_s) for rs in runs.values() for run in rs) if c]
    for c in plans:
        score(c[-1]["path"])
    for c in plans:  # in time order up to the first at or above the target
        for ckpt in c:
            if score(ckpt["path"])["success"] >= target:
                break
    if curves:
        for c in plans:
            for ckpt in c:
                score(ckpt["path"])


def held_out_result(path: str, problems: int) -> dict[str, Any]:
    """bench/heldout.py's greedy success of the model directory `path` on `problems` held-out problems."""
    from real_model import held_out

    r = held_out(Path(path), problems)
    return {"success": r.success, "stderr": r.stderr, "problems": r.problems, "outcomes": r.outcomes,
            "seconds": round(r.seconds, 1)}


def in_budget(run: dict[str, Any], budget_s: float) -> list[dict[str, Any]]:
    """The run's checkpoints whose step ended within the budget, in time order."""
    return sorted((c for c in run.get("checkpoints", []) if c["t"] <= budget_s), key=lambda c: c["t"])


def first_hit(ckpts: list[dict[str, Any]], evals: dict[str, Any], target: float | None) -> tuple[float | None, bool]:
    """(the time of the first checkpoint at or above `target`, reading them in time order, or None when none was;
    whether that is known: False when a checkpoint before the first hit (or any, without one) is not scored yet)."""
    for c in ckpts:
        if target is None or c["path"] not in evals:
            return None, False
        if evals[c["path"]]["success"] >= target - 1e-12:
            return float(c["t"]), True
    return None, True


def summarise(runs: dict[str, list[dict[str, Any]]], evals: dict[str, Any], base: str, gain: float,
              budget_s: float) -> dict[str, Any]:
    """The part's keys from the recorded runs and the evaluations made so far (a run not yet evaluated: null)."""
    before = evals.get(base)
    target = before["success"] + gain if before else None
    at_budget: dict[str, list[float | None]] = {}
    unknown: list[str] = []
    to_target: dict[str, list[float | None]] = {}
    for system, rs in runs.items():
        at_budget[system], to_target[system] = [], []
        for run in rs:
            ckpts = in_budget(run, budget_s)
            last = evals.get(ckpts[-1]["path"]) if ckpts else None
            run["heldout"] = [{**c, **evals[c["path"]]} for c in ckpts if c["path"] in evals]
            at_budget[system].append(last["success"] if last else None)
            t, known = first_hit(ckpts, evals, target)
            to_target[system].append(t)
            if not known:
                unknown.append(f"{system} seed {run.get('seed')}")
    notes = [f"each run has {budget_s:.0f} s from launch; a checkpoint counts at the end of the step it holds"]
    earl, trl = to_target.get("earl_stream", []), to_target.get("trl", [])
    ratio: dict[str, Any] | None = None
    if unknown:
        notes.append(f"time_to_target_vs_trl is null: the time to target of {', '.join(unknown)} is not known yet (a "
                     "checkpoint before its first hit, or any without one, is not scored; `--smollm2-stage eval` "
                     "resumes)")
    elif earl and trl and None not in earl and None not in trl:
        ratio = ratio_interval([float(x) for x in earl if x is not None], [float(x) for x in trl if x is not None])
    elif earl and trl and None not in earl and all(x is None for x in trl):
        ratio = {"mean": None, "at_most": (sum(x for x in earl if x is not None) / len(earl)) / budget_s,
                 "n": len(earl), "trl_reached": False}
        notes.append(f"time_to_target_vs_trl: no TRL run reached the target within {budget_s:.0f} s; every earl_stream "
                     "run did: `at_most` bounds the ratio (earl_stream's mean over the budget)")
    else:
        notes.append(f"time_to_target_vs_trl is null: not every earl_stream run reached the target within the budget, "
                     f"or the TRL runs are split (seconds: earl_stream {earl}, trl {trl})")
    return {
        "heldout_before": before, "target_success": target, "target_gain": gain, "budget_s": budget_s,
        "heldout_at_budget": {s: interval([x for x in v if x is not None]) for s, v in at_budget.items()},
        "heldout_at_budget_per_seed": at_budget,
        "loss_tokens_per_s": {s: interval([r["loss_tokens_per_s"] for r in rs if r.get("loss_tokens_per_s")])
                              for s, rs in runs.items()},
        "time_to_target_s": to_target, "time_to_target_unknown": unknown, "time_to_target_vs_trl": ratio, "runs": runs,
        "notes": notes,
    }


def run_part(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Train (stage train/all: the runs WORK/runs.json lacks), evaluate (stage eval/all), summarise."""
    work = Path(args.smollm2_work)
    work.mkdir(parents=True, exist_ok=True)
    runs_file, evals_file = work / "runs.json", work / "evals.json"
    runs: dict[str, list[dict[str, Any]]] = json.loads(runs_file.read_text()) if runs_file.exists() else {}
    runs = {s: runs.get(s, []) for s in SYSTEMS}
    budget_s = args.smollm2_minutes * 60
    if args.smollm2_stage in ("train", "all"):
        for seed in range(args.seeds):
            order = SYSTEMS if seed % 2 == 0 else SYSTEMS[::-1]  # which goes first alternates: a drift falls on both
            for system in order:
                if any(r["seed"] == seed for r in runs[system]):
                    print(f"smollm2: {system}, seed {seed}: kept from {runs_file}", flush=True)
                    continue
                print(f"smollm2: {system}, seed {seed}, {args.smollm2_minutes} min ...", flush=True)
                run = (train_earl(model_dir, seed, args.smollm2_minutes, args.save_every, work) if system == "earl_stream"
                       else train_trl(model_dir, seed, args.smollm2_minutes, args.save_every, work, args.smollm2_trl_threads))
                runs[system].append(run)
                runs_file.write_text(json.dumps(runs, indent=1))
                print(json.dumps({k: v for k, v in run.items() if k not in ("curve", "checkpoints")})[:800], flush=True)
    evals: dict[str, Any] = json.loads(evals_file.read_text()) if evals_file.exists() else {}
    if args.smollm2_stage in ("eval", "all"):
        evaluate_runs(runs, evals, str(model_dir), budget_s, args.smollm2_gain,
                      lambda path: held_out_result(path, args.smollm2_problems),
                      lambda e: evals_file.write_text(json.dumps(e, indent=1)), curves=args.smollm2_curves)
    out = summarise(runs, evals, str(model_dir), args.smollm2_gain, budget_s)
    return {**out, "train_seconds": round(sum(r.get("wall_seconds") or 0 for rs in runs.values() for r in rs), 1),
            "model": "SmolLM2-135M-Instruct", "config": str(CONFIG.relative_to(ROOT)), "seeds": args.seeds,
            "problems": args.smollm2_problems, "save_every": args.save_every,
            "core_assignment": {"earl_stream": "rollout pool CPU 0, trainer CPU 1 (the config's)",
                                "trl": f"all CPUs (not pinned), {args.smollm2_trl_threads} torch threads"},
            "loss_tokens": "tokens that receive gradient: earl_stream's trainer log (samples dynamic sampling kept); "
                           "TRL: the completion tokens of every trained sample (mean length x samples)"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--smollm2-minutes", type=float, default=10.0, help="part smollm2: wall minutes per run, from launch")
    ap.add_argument("--smollm2-work", default="",
                    help="part smollm2: runs, checkpoints and evaluations (kept: the stages resume from it); default "
                         "runs/e2e_smollm2 (runs/e2e_smollm2_quick with --quick)")
    ap.add_argument("--smollm2-stage", choices=("train", "eval", "all"), default="all",
                    help="part smollm2: train (needs a quiet machine), eval (does not), or both")
    ap.add_argument("--smollm2-problems", type=int, default=200, help="part smollm2: held-out problems per evaluation")
    ap.add_argument("--smollm2-gain", type=float, default=0.10, help="part smollm2: the target, over the base's success")
    ap.add_argument("--smollm2-curves", action="store_true",
                    help="part smollm2: score every checkpoint within the budget, not only up to the first at the "
                         "target (whole held-out curves; ~1 min an evaluation here)")
    ap.add_argument("--smollm2-trl-threads", type=int, default=2, help="part smollm2: TRL's torch threads")
    ap.add_argument("--save-every", type=int, default=2, help="part smollm2: steps between checkpoints, both systems")


if __name__ == "__main__":
    sys.exit("run it as bench/e2e.py --part smollm2")
