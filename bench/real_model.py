"""Real-model benchmark: SmolLM2-135M-Instruct (from `make real-model`) trained by `earl-stream up` on
configs/smollm2_arithmetic.yaml within a time budget, with held-out success before and after, then the same
config run asynchronously and synchronously side by side (`async_vs_sync`).

    python bench/real_model.py --minutes 60 --json bench/results/real_model.json [overrides...]
    python bench/real_model.py --quick        # 2 training steps, 24 held-out problems, a 2-step comparison
    python bench/real_model.py --compare-only --compare-steps 6 --json bench/results/real_model_async_vs_sync.json

1. The model: the directory `scripts/real-model.sh` imports (run here if it is missing; if that fails, the
   benchmark says so and exits 1 without measuring anything, the comparison included).
2. Held-out success before: greedy, on `--problems` (>= 200) questions the training environment never poses
   (bench/heldout.py: another dataset seed, every question of the training dataset removed), exact check;
   reported with its binomial standard error.
3. `earl-stream up --config configs/smollm2_arithmetic.yaml` until the budget is spent (then SIGTERM: the
   trainer writes a final checkpoint), the reward curve polled from the supervisor every `--every` seconds.
4. Held-out success after: the same problems, the base model with the run's latest checkpoint loaded.
5. The async/sync comparison (`--compare-steps N`, default 6; 0 skips it; `--compare-only` runs nothing
   else): two fresh runs of the same config and overrides, one after the other, the rollout pool on CPU 0
   and the trainer pool on CPU 1 as bench/e2e.py pins them: `async` at the config's staleness bound, `sync`
   with `trainer.max_staleness=0` (generate, train, generate). Each runs 1 + N steps; samples/s is measured
   over the N steady-state steps (from the trainer log's line of the first step polled, step 1 unless a
   poll missed it, to that of the N-th after it), so start-up and the first step are left out.
   `async_vs_sync_ceiling` is the sync run's (generation + training) / max(generation, training) CPU
   seconds per step, as bench/e2e.py computes it; `fraction_of_ceiling` = async_vs_sync / that ceiling.
Writes JSON (eval_success_before/_after and their _stderr, tokens_per_second_generated/_trained: episode
tokens produced / trained per second of the run, minutes, curve, the supervisor's last status;
async_samples_per_s, sync_samples_per_s, async_vs_sync, async_vs_sync_ceiling, fraction_of_ceiling and
the two runs' details under `async_vs_sync_runs`) and a PNG of the reward curve next to it. With
`--compare-only` the comparison's keys are merged into the JSON file if it exists (the training run's
results in it are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout import evaluate  # noqa: E402
from pipeline_rates import MODE_OVERRIDES, PINNED_POOLS, Snapshot, overlap_ceiling, step_window, watch_up  # noqa: E402

from earl_stream.model import cache_dir, load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_arithmetic.yaml"


def model_dir() -> Path:
    path = cache_dir() / "models" / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        print(f"SmolLM2-135M-Instruct is not imported at {path}: importing it (scripts/real-model.sh)", flush=True)
        try:
            subprocess.run(["bash", str(ROOT / "scripts" / "real-model.sh"), str(path)], check=True,
                           env={**os.environ, "PY": sys.executable})
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"SmolLM2-135M-Instruct is not imported ({path}/config.json is missing) and "
                             f"scripts/real-model.sh could not import it (exit {e.returncode}): run `make real-model`. "
                             "Skipped: the held-out evaluation, the training run and the async/sync comparison.") from e
    return path


def env_params() -> dict[str, Any]:
    return dict(yaml.safe_load(CONFIG.read_text())["envs"][0]["params"])


def held_out(path: Path, problems: int, checkpoint: Path | None = None) -> Any:
    import torch

    torch.set_num_threads(2)
    model, tokenizer = load_model(path)
    if checkpoint is not None:
        from earl_stream.workers.checkpoint import load_model_weights

        load_model_weights(checkpoint, model)
    return evaluate(model.eval(), tokenizer, env_params(), problems=problems)


def train(path: Path, run_dir: Path, args: argparse.Namespace, config: Path = CONFIG) -> tuple[list[dict], dict, float]:
    """Run `up` on `config` for the budget (or --steps); returns (reward curve, the supervisor's last status, wall
    seconds). bench/lora.py runs it on configs/smollm2_arithmetic_lora.yaml too."""
    steps = ["--steps", str(args.steps)] if args.steps else []
    up_args = ["--config", str(config), *steps, "--summary", str(run_dir / "summary.json"), f"model.path={path}",
               f"run_dir={run_dir}", *args.overrides]
    curve: list[dict] = []

    def point(now: Snapshot) -> None:
        curve.append({"t": round(now.t, 1), "step": now.step, "reward": now.status.get("mean_reward_last"),
                      "episodes": now.status.get("samples_produced")})
        print(json.dumps(curve[-1]), flush=True)

    start = time.monotonic()
    def done(now: Snapshot, first: Snapshot | None) -> bool:  # with --steps, `up` stops itself: no time limit
        return not args.steps and now.t >= args.minutes * 60

    watch = watch_up(up_args, run_dir, done, what="training",
                     poll_s=args.every, exit_ok=True, term_wait_s=600, on_poll=point)
    return curve, watch.snapshots[-1].status if watch.snapshots else {}, time.monotonic() - start


def compare(path: Path, root: Path, steps: int, overrides: list[str]) -> dict[str, Any]:
    """The async/sync comparison (module docstring, 5): two fresh runs of 1 + `steps` steps in `root`/<mode>."""
    from earl_stream.workers.checkpoint import checkpoints_dir

    started, load_before = time.monotonic(), os.getloadavg()
    runs: dict[str, dict[str, Any]] = {}
    for mode in ("async", "sync"):
        run_dir = root / mode
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: nothing to resume from
        up_args = ["--config", str(CONFIG), "--summary", str(run_dir / "summary.json"), f"model.path={path}",
                   f"run_dir={run_dir}", *PINNED_POOLS, *overrides, *MODE_OVERRIDES[mode]]
        print(f"async/sync comparison: {mode}, 1 + {steps} steps ...", flush=True)
        watch = watch_up(up_args, run_dir, lambda now, first: first is not None and now.step >= first.step + steps,
                         what=f"comparison, {mode}", poll_s=0.5, term_wait_s=600)
        runs[mode] = {"overrides": MODE_OVERRIDES[mode], **step_window(watch, run_dir)}
        shutil.rmtree(checkpoints_dir(run_dir), ignore_errors=True)  # the stop's checkpoint (~1.6 GB): not needed
        print(json.dumps(runs[mode]), flush=True)
    a, s = runs["async"]["samples_per_s"], runs["sync"]["samples_per_s"]
    result: dict[str, Any] = {"async_samples_per_s": a, "sync_samples_per_s": s, "async_vs_sync": a / s,
                              **overlap_ceiling(runs["sync"]["cpu_seconds_per_step"])}
    ceiling = result.get("async_vs_sync_ceiling")
    result["fraction_of_ceiling"] = a / s / ceiling if ceiling else None
    result["async_vs_sync_steps"] = steps
    result["async_vs_sync_window"] = (
        f"steady state: the {steps} steps after the first step polled (step 1 unless a poll missed it), timed by "
        "the trainer log's step lines; start-up (model load, first weights) and step 1 are left out")
    result["async_vs_sync_setup"] = {
        "config": str(CONFIG.relative_to(ROOT)), "overrides": [*PINNED_POOLS, *overrides],
        "cores": "rollout pool on CPU 0, trainer pool on CPU 1 (one torch thread each); supervisor not pinned",
        "wall_seconds": round(time.monotonic() - started, 1),
        "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()}}
    result["async_vs_sync_runs"] = runs
    return result


def plot(curve: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in curve if p["reward"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["t"] / 60 for p in points], [p["reward"] for p in points], marker=".")
    ax.set_xlabel("minutes")
    ax.set_ylabel("mean reward (recent episodes)")
    ax.set_title("SmolLM2-135M-Instruct on " + CONFIG.name)
    fig.tight_layout()
    fig.savefig(png)


def train_and_evaluate(path: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Steps 2-4 of the module docstring: held-out before, the training run, held-out after."""
    run_dir = out.parent / "real_model_run"
    before = held_out(path, args.problems)
    print(f"held-out success before: {before.success:.3f} +- {before.stderr:.3f} ({before.problems} problems)")
    curve, status, wall = train(path, run_dir, args)
    run_s = status.get("wall_seconds") or 0.0
    produced, consumed = status.get("samples_produced", 0), status.get("samples_consumed", 0)
    tokens = status.get("tokens_produced", 0)  # prompt + generated tokens of every finished episode
    from earl_stream.workers.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    after = held_out(path, args.problems, ckpt) if ckpt is not None else None
    plot(curve, out.with_suffix(".png"))
    return {
        "quick": args.quick, "minutes": round(wall / 60, 2), "problems": before.problems,
        "eval_success_before": before.success, "eval_success_before_stderr": before.stderr,
        "eval_success_after": after.success if after else None,
        "eval_success_after_stderr": after.stderr if after else None,
        # episode tokens (prompts included) produced per second of the run, and the share of them trained on
        "tokens_per_second_generated": tokens / run_s if run_s else None,
        "tokens_per_second_trained": tokens * consumed / produced / run_s if run_s and produced else None,
        "checkpoint": str(ckpt) if ckpt else None, "overrides": args.overrides, "curve": curve,
        "status": {k: status.get(k) for k in ("policy_version", "samples_produced", "samples_consumed",
                                              "tokens_produced", "wall_seconds", "trainer")},
        "outcomes_before": before.outcomes, "outcomes_after": after.outcomes if after else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="training time budget")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps instead (0 = the budget)")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems (>= 200 for the reported number)")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between curve points")
    ap.add_argument("--compare-steps", type=int, default=6,
                    help="steady-state steps measured per mode in the async/sync comparison, after step 1 (0 = skip it)")
    ap.add_argument("--compare-only", action="store_true",
                    help="only the async/sync comparison (no held-out evaluation, no training run); its keys are "
                         "merged into --json if that file exists")
    ap.add_argument("--quick", action="store_true",
                    help="2 steps, 24 problems, a 2-step comparison (2 groups of 4 per step): checks the pipeline, not the goal")
    ap.add_argument("--json", default="bench/results/real_model.json")
    ap.add_argument("overrides", nargs="*", help="config overrides passed to `earl-stream up` (training and comparison)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.problems, args.every = 2, min(args.problems, 24), 10.0
        args.compare_steps = min(args.compare_steps, 2)
        args.overrides = ["trainer.groups_per_step=2", "trainer.group_size=4", *args.overrides]
    if args.compare_only and args.compare_steps < 1:
        ap.error("--compare-only needs --compare-steps >= 1")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    path = model_dir()
    result: dict[str, Any] = {}
    if args.compare_only and out.exists():
        result = json.loads(out.read_text())
    if not args.compare_only:
        result = train_and_evaluate(path, out, args)
        write_result(out, result, indent=2)  # kept should the comparison fail
    if args.compare_steps:
        result.update(compare(path, out.parent / "real_model_compare_run", args.compare_steps, args.overrides))
        write_result(out, result, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("curve", "status", "async_vs_sync_runs")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
