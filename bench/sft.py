"""SFT warm start of the embedded model through `earl-stream sft` against the warm start's own loop before it
became a caller of SFT (the code of commit --baseline-ref, default f664abf, checked out with `git worktree`
into a temporary directory; --baseline-src names a checkout instead), side by side: legal-move rate, win
rate (temperature 1.0, `warmstart.evaluate_game`) and training time.

    python bench/sft.py [--steps 150] [--eval-games 200] [--baseline-ref f664abf] [--out bench/results/sft.json]

The transcripts are the warm start's own synthetic games (uniformly random legal moves by the model's
side, same seed, same number of games) written as JSONL chat messages; `earl-stream sft` trains on them
with the warm start's knobs (lr 3e-3, AdamW betas 0.9/0.98, warm-up 20 steps, linear decay over the last
30 %, context_weight 0.3, 16 transcripts a step). The full-length recipe is --steps 1350.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GAME = "tictactoe"


def transcripts(path: Path, games: int, seed: int) -> None:
    """`games` synthetic games as {"messages": [...]} lines (the warm start's rng order and seeds)."""
    from earl_stream.model.warmstart import _drive, resolve_game

    factory = resolve_game(GAME)
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(games):
            env = factory()
            game_seed = rng.getrandbits(31)
            msgs = [{"role": "system", "content": env.system_prompt},
                    {"role": "user", "content": _drive(env.reset(game_seed))}]
            while True:
                move = rng.choice(env.legal_moves())
                msgs.append({"role": "assistant", "content": str(move)})
                result = _drive(env.step(str(move)))
                if result.done:
                    break
                msgs.append({"role": "user", "content": result.observation})
            fh.write(json.dumps({"messages": msgs}) + "\n")


def evaluate(model_dir: Path, games: int, seed: int) -> dict[str, float]:
    from earl_stream.model.loading import load_model
    from earl_stream.model.warmstart import evaluate_game, resolve_game

    model, tok = load_model(model_dir)
    legal, win, draw = evaluate_game(model, tok, resolve_game(GAME), games=games, seed=seed)
    return {"legal_rate": legal, "win_rate": win, "draw_rate": draw}


def run(cmd: list[str], env: dict[str, str]) -> float:
    start = time.monotonic()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-games", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-ref", default="f664abf", help="a commit whose warm start is the old loop")
    ap.add_argument("--baseline-src", default="", help="a checkout whose warm start is the old loop (instead of --baseline-ref)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/sft.json"))
    args = ap.parse_args()
    from earl_stream.model.tiny import init_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-sft-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    base_dir, sft_dir, out_dir = tmp / "baseline", tmp / "init", tmp / "sft"
    init_model(base_dir, seed=args.seed)
    init_model(sft_dir, seed=args.seed)
    data = tmp / "games.jsonl"
    t0 = time.monotonic()
    transcripts(data, args.steps * 16, args.seed)
    gen_seconds = time.monotonic() - t0
    old = ("import sys, json, torch; torch.set_num_threads(1); from earl_stream.model.warmstart import warm_start; "
           f"r = warm_start({str(base_dir)!r}, {GAME!r}, seconds=1e9, max_steps={args.steps}, eval_games=0, "
           f"seed={args.seed}); print(json.dumps(r.as_dict()))")
    src = args.baseline_src
    if not src:
        src = str(tmp / "baseline-src")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", src, args.baseline_ref], check=True,
                       capture_output=True)
    try:
        base_seconds = run([sys.executable, "-c", old], {**env, "PYTHONPATH": src})
    finally:
        if not args.baseline_src:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", src], capture_output=True)
    sft_cmd = [sys.executable, "-m", "earl_stream", "sft", "--model", str(sft_dir), "--data", str(data), "--out",
               str(out_dir), "lr=3e-3", "beta2=0.98", "batch_size=16", f"steps={args.steps}", "warmup_steps=20",
               "decay_fraction=0.3", "min_lr_ratio=0.1", "context_weight=0.3", f"seed={args.seed}",
               "micro_batch_tokens=1048576"]
    sft_seconds = run(sft_cmd, {**env, "PYTHONPATH": str(ROOT)})
    report = json.loads((out_dir / "sft_report.json").read_text())
    result: dict[str, Any] = {
        "steps": args.steps, "eval_games": args.eval_games, "transcripts": args.steps * 16,
        "baseline_warm_start": {"src": args.baseline_src or f"commit {args.baseline_ref}", "wall_seconds": round(base_seconds, 1),
                                **evaluate(base_dir, args.eval_games, args.seed)},
        "earl_stream_sft": {"wall_seconds": round(sft_seconds, 1), "train_seconds": report["train_seconds"],
                            "first_loss": report["first_loss"], "final_loss": report["final_loss"],
                            "transcript_seconds": round(gen_seconds, 1), **evaluate(out_dir, args.eval_games, args.seed)},
    }
    print(json.dumps(result, indent=2))
    write_result(args.out, result, depends_on=["earl_stream/sft", "earl_stream/cli/sft.py",
                                               "earl_stream/model/warmstart.py"])


if __name__ == "__main__":
    main()
