"""On-policy distillation with a teacher worth learning from, against GRPO alone.

    python bench/distill.py [--seeds 3] [--minutes 5] [--teacher-steps 450] [--teacher-run DIR] [--window 256]
                            [--target 0.9] [--coef 0.1] [--quick] [--out bench/results/distill.json]

The teacher is the embedded default after a full learning run: `earl-stream up --steps 450 seed=1000` on the
default (--teacher-steps; 450 steps take ~10 minutes here), its last checkpoint; --teacher-run DIR reuses such a
run made earlier (`earl-stream up --steps N --summary DIR/summary.json run_dir=DIR seed=1000
trainer.checkpoint_every=50`). The student is the default's
warm start (`ensure_default_model`, ~0.59 win rate). Three arms, each `earl-stream up` from the student for
--minutes of wall time, all else equal:

- `grpo`: the default algorithm alone;
- `distill_reward`: + `algo.distill` in reward mode (the episode's summed reverse KL to the teacher
  subtracted from its reward);
- `distill_loss`: + `algo.distill` in loss mode (coef x k2 per loss token in the policy loss).

Arms are interleaved by seed (grpo, reward, loss, grpo, ...), so load drifts hit all alike. The win rate is
the run's own over its last --window games against the random opponent (the supervisor's
`win_rate_last`, sampled every 5 s); a run reaches the target at the first full window at or above it.
Reported per seed: the policy version (steps) and seconds at the target, and the final window's win rate
at the end of the budget. `best_distill_vs_grpo_steps` is the distillation arm with the lower mean of the
per-seed ratios steps(distill) / steps(grpo), over the seeds where both reached the target, with its 95%
interval (goal: <= 0.5). The teacher and the student are also scored by `warmstart.evaluate_game` (temperature
1.0, --eval-games games). Runs ~1 hour with the defaults (3 seeds x 3 arms x 5 minutes, a ~10-minute teacher).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learning import run_curve  # noqa: E402
from provenance import write_result  # noqa: E402
from stats import mean_ci95  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("grpo", "distill_reward", "distill_loss")
DEPENDS_ON = ["bench/distill.py", "earl_stream/algo/distill.py", "earl_stream/workers/train_step.py",
              "earl_stream/workers/rollout.py", "earl_stream/model/default.py"]


def arm_overrides(arm: str, teacher: str, coef: float) -> list[str]:
    """What `earl-stream up` gets beside the shared settings for `arm`."""
    if arm == "grpo":
        return []
    mode = arm.removeprefix("distill_")
    return [f"algo.distill.teacher={teacher}", f"algo.distill.coef={coef}", f"algo.distill.mode={mode}"]


def reached(curve: list[dict], target: float) -> dict[str, Any] | None:
    """The first point of `curve` whose window is full and at or above `target`."""
    return next((p for p in curve if p.get("full", True) and p["win"] >= target), None)


def run_figures(curve: list[dict], target: float) -> dict[str, Any]:
    """One run's figures: steps and seconds to `target` (None if never), final win rate, steps in all."""
    hit = reached(curve, target)
    full = [p for p in curve if p.get("full", True)]
    return {"steps_to_target": hit["step"] if hit else None, "seconds_to_target": hit["t"] if hit else None,
            "final_win_rate": full[-1]["win"] if full else None, "steps": curve[-1]["step"] if curve else 0,
            "seconds": curve[-1]["t"] if curve else 0.0}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's keys from its runs (each {"arm", "seed", "overrides", figures of `run_figures`}).

    ValueError if a distillation arm ran the same configuration as GRPO (no comparison between identical
    arms is a speedup)."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    seeds = sorted({r["seed"] for r in runs})
    grpo = by_arm.get("grpo", {})
    out: dict[str, Any] = {
        key: {arm: [by_arm[arm][s][key] if s in by_arm[arm] else None for s in seeds] for arm in by_arm}
        for key in ("steps_to_target", "seconds_to_target", "final_win_rate")}
    out["seeds"] = seeds
    out["final_win_rate_mean"] = {arm: _mean_or_none(v) for arm, v in out["final_win_rate"].items()}
    ratios: dict[str, Any] = {}
    for arm, per_seed in by_arm.items():
        if arm == "grpo":
            continue
        for s, run in per_seed.items():
            if s in grpo and sorted(run["overrides"]) == sorted(grpo[s]["overrides"]):
                raise ValueError(f"{arm} ran the same configuration as grpo (seed {s}): not a comparison")
        pairs = [per_seed[s]["steps_to_target"] / grpo[s]["steps_to_target"] for s in seeds
                 if s in per_seed and s in grpo and per_seed[s]["steps_to_target"] and grpo[s]["steps_to_target"]]
        ratios[arm] = {"per_seed": pairs, **(mean_ci95(pairs) if len(pairs) >= 2
                                             else {"mean": pairs[0] if pairs else None, "n": len(pairs)})}
    out["distill_vs_grpo_steps"] = ratios
    ranked = sorted((r["mean"], arm) for arm, r in ratios.items() if r.get("mean") is not None)
    out["best_distill_vs_grpo_steps"] = ({"arm": ranked[0][1], **ratios[ranked[0][1]]} if ranked else None)
    return out


def _mean_or_none(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def evaluate(model_dir: Path, games: int) -> dict[str, float]:
    """Win, draw and legal rates of `model_dir` against the random opponent at temperature 1.0."""
    from earl_stream.model.loading import load_model
    from earl_stream.model.warmstart import evaluate_game, resolve_game

    model, tok = load_model(model_dir)
    legal, win, draw = evaluate_game(model, tok, resolve_game("tictactoe"), games=games, seed=7)
    return {"legal_rate": legal, "win_rate": win, "draw_rate": draw}


def train_teacher(run_dir: Path, steps: int) -> None:
    """The default's own learning run of `steps` steps in `run_dir` (its summary in run_dir/summary.json)."""
    subprocess.run([sys.executable, "-m", "earl_stream", "up", "--steps", str(steps), "--summary",
                    str(run_dir / "summary.json"), f"run_dir={run_dir}", "seed=1000", "trainer.checkpoint_every=50"],
                   check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def teacher_of(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """A teacher run's last checkpoint and its summary."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not checkpoints:
        raise SystemExit(f"the teacher's run left no checkpoint in {run_dir / 'checkpoints'}")
    return checkpoints[-1], json.loads((run_dir / "summary.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="repeats per arm (seeds 0..N-1), interleaved")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall-time budget of each arm's run")
    ap.add_argument("--teacher-steps", type=int, default=450, help="steps of the teacher's learning run")
    ap.add_argument("--teacher-run", default="", help="reuse this teacher run (its checkpoints and summary.json)")
    ap.add_argument("--window", type=int, default=256, help="games in the win-rate window")
    ap.add_argument("--target", type=float, default=0.9, help="win rate whose steps and seconds are reported")
    ap.add_argument("--also-target", type=float, default=0.8, help="a second target from the same runs (a win rate "
                    "the teacher exceeds, where it does not exceed --target), summarised under `at_second_target`")
    ap.add_argument("--coef", type=float, default=0.1, help="algo.distill.coef of both distillation arms")
    ap.add_argument("--eval-games", type=int, default=512, help="games scoring the teacher and the student")
    ap.add_argument("--quick", action="store_true", help="1 seed, 1-minute arms, a 2-minute teacher (a check)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/distill.json"))
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.minutes, args.teacher_steps, args.eval_games = 1, 1.0, 40, 64
    from earl_stream.model import ensure_default_model
    from earl_stream.progress import progress

    tmp = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    student = ensure_default_model()
    teacher_run = Path(args.teacher_run) if args.teacher_run else tmp / "teacher"
    if not args.teacher_run:
        train_teacher(teacher_run, args.teacher_steps)
    teacher, teacher_summary = teacher_of(teacher_run)
    result: dict[str, Any] = {
        "teacher": str(teacher), "teacher_run_steps": teacher_summary.get("policy_version"),
        "teacher_run_seconds": teacher_summary.get("wall_seconds"),
        "teacher_run_final_win_rate": teacher_summary.get("win_rate_last"),
        "teacher_eval": evaluate(teacher, args.eval_games), "student": str(student),
        "student_eval": evaluate(student, args.eval_games), "minutes_per_run": args.minutes,
        "window_games": args.window, "target_win_rate": args.target, "coef": args.coef, "eval_games": args.eval_games,
        "unit": "steps (policy versions) and seconds of wall time to the target; win rate over the last window"}
    result["teacher_win_rate"] = result["teacher_eval"]["win_rate"]
    runs: list[dict[str, Any]] = []
    plan = [(seed, arm) for seed in range(args.seeds) for arm in ARMS]
    with progress(f"distill ({args.minutes:g} min a run)", len(plan), "runs") as bar:
        for seed, arm in plan:
            bar.update(bar.done, note=f"{arm} seed {seed}")
            overrides = [f"seed={seed}", *arm_overrides(arm, str(teacher), args.coef)]
            curve = run_curve(overrides, minutes=args.minutes, window=args.window, every=5.0,
                              run_dir=tmp / f"{arm}_{seed}")
            second = run_figures(curve, args.also_target)
            runs.append({"arm": arm, "seed": seed, "overrides": overrides, **run_figures(curve, args.target),
                         "second_target": {k: second[k] for k in ("steps_to_target", "seconds_to_target")},
                         "curve": [{k: p[k] for k in ("t", "step", "win", "full")} for p in curve]})
            bar.advance(note=f"{arm} seed {seed}: {runs[-1]['steps_to_target']} steps to the target")
    result.update(summarise(runs))
    result["at_second_target"] = {"target_win_rate": args.also_target,
                                  **summarise([{**r, **r["second_target"]} for r in runs])}
    result["runs"] = runs
    write_result(args.out, result, depends_on=DEPENDS_ON)
    print({k: result[k] for k in ("teacher_win_rate", "steps_to_target", "final_win_rate_mean",
                                  "best_distill_vs_grpo_steps")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
