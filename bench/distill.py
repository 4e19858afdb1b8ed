"""On-policy distillation vs plain GRPO on the embedded Tic-Tac-Toe task, same budget.

    python bench/distill.py [--steps 20] [--student-steps 150] [--every 5] [--eval-games 100]
                            [--coef 0.1] [--mode reward] [--out bench/results/distill.json]

The student is the embedded tiny model warm-started for only --student-steps supervised steps; the
teacher is the fully warm-started embedded model (`ensure_default_model`, 1,350 steps). Both arms run
`earl-stream up` from the student for --steps training steps with the same seed and knobs, one with
`algo.distill.teacher=<teacher>`. Win rate over training: each checkpoint (every --every steps, step 0
being the student) plays --eval-games games at temperature 1.0 (`warmstart.evaluate_game`). Longer runs:
--steps 200 --every 25.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def evaluate(model_dir: Path, games: int) -> dict[str, float]:
    from earl_stream.model.loading import load_model
    from earl_stream.model.warmstart import evaluate_game, resolve_game

    model, tok = load_model(model_dir)
    legal, win, draw = evaluate_game(model, tok, resolve_game("tictactoe"), games=games, seed=7)
    return {"legal_rate": legal, "win_rate": win, "draw_rate": draw}


def arm(name: str, student: Path, tmp: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    run_dir = tmp / name
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", str(args.steps), "--summary", str(tmp / f"{name}.json"),
           f"model.path={student}", f"run_dir={run_dir}", f"trainer.checkpoint_every={args.every}",
           "rollout.workers=1", f"seed={args.seed}", *extra]
    start = time.monotonic()
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                         "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.monotonic() - start
    curve = [{"step": 0, **evaluate(student, args.eval_games)}]
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        curve.append({"step": int(ckpt.name.split("_")[1]), **evaluate(ckpt, args.eval_games)})
    summary = json.loads((tmp / f"{name}.json").read_text())
    return {"wall_seconds": round(wall, 1), "curve": curve, "win_rate_last_window": summary.get("win_rate_last"),
            "extra_overrides": extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--student-steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--eval-games", type=int, default=100)
    ap.add_argument("--coef", type=float, default=0.1)
    ap.add_argument("--mode", default="reward", choices=("reward", "loss"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/distill.json"))
    args = ap.parse_args()
    import torch

    from earl_stream.model import ensure_default_model
    from earl_stream.model.tiny import init_model
    from earl_stream.model.warmstart import warm_start

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    teacher = ensure_default_model()
    student = tmp / "student"
    init_model(student, seed=args.seed)
    warm = warm_start(student, "tictactoe", seconds=1e9, max_steps=args.student_steps, eval_games=0, seed=args.seed)
    result: dict[str, Any] = {"steps": args.steps, "student_warm_start_steps": args.student_steps,
                              "teacher": str(teacher), "teacher_eval": evaluate(teacher, args.eval_games),
                              "student_warm_start_seconds": warm.train_seconds, "coef": args.coef, "mode": args.mode,
                              "eval_games": args.eval_games}
    result["grpo"] = arm("grpo", student, tmp, args, [])
    result["distill"] = arm("distill", student, tmp, args, [f"algo.distill.teacher={teacher}",
                                                             f"algo.distill.coef={args.coef}",
                                                             f"algo.distill.mode={args.mode}"])
    print(json.dumps(result, indent=2))
    write_result(args.out, result, depends_on=["earl_stream/algo/distill.py", "earl_stream/workers/train_step.py",
                                               "earl_stream/workers/rollout.py"])


if __name__ == "__main__":
    main()
