"""Real-model benchmark: SmolLM2-135M-Instruct (from `make real-model`) trained by `earl-stream up` on
configs/smollm2_arithmetic.yaml within a time budget, with held-out success before and after.

    python bench/real_model.py --minutes 60 --json bench/results/real_model.json [overrides...]
    python bench/real_model.py --quick        # 2 training steps and 24 held-out problems: checks the pipeline

1. The model: the directory `scripts/real-model.sh` imports (run here if it is missing).
2. Held-out success before: greedy, on `--problems` (>= 200) questions the training environment never poses
   (bench/heldout.py: another dataset seed, every question of the training dataset removed), exact check;
   reported with its binomial standard error.
3. `earl-stream up --config configs/smollm2_arithmetic.yaml` until the budget is spent (then SIGTERM: the
   trainer writes a final checkpoint), the reward curve polled from the supervisor every `--every` seconds.
4. Held-out success after: the same problems, the base model with the run's latest checkpoint loaded.
Writes JSON (eval_success_before/_after and their _stderr, tokens_per_second_generated/_trained: episode
tokens produced / trained per second of the run, minutes, curve, the supervisor's last status) and a PNG
of the reward curve next to it.
Not measured here yet: the synchronous loop side by side (`async_vs_sync`) that the issue also asks for.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout import evaluate  # noqa: E402

from earl_stream import protocol as P  # noqa: E402
from earl_stream.errors import EarlError  # noqa: E402
from earl_stream.model import cache_dir, load_model  # noqa: E402
from earl_stream.security import SECRET_ENV, create_secret_file, load_secret  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_arithmetic.yaml"


def model_dir() -> Path:
    path = cache_dir() / "models" / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        subprocess.run(["bash", str(ROOT / "scripts" / "real-model.sh"), str(path)], check=True,
                       env={**os.environ, "PY": sys.executable})
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


def train(path: Path, run_dir: Path, args: argparse.Namespace) -> tuple[list[dict], dict, float]:
    """Run `up` for the budget (or --steps); returns (reward curve, the supervisor's last status, wall seconds)."""
    summary = run_dir / "summary.json"
    steps = ["--steps", str(args.steps)] if args.steps else []
    cmd = [sys.executable, "-m", "earl_stream", "up", "--config", str(CONFIG), *steps, "--summary", str(summary),
           f"model.path={path}", f"run_dir={run_dir}", *args.overrides]
    ready = run_dir / "supervisor.json"
    ready.unlink(missing_ok=True)
    secret = create_secret_file(run_dir / "secret")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, SECRET_ENV: str(secret)})
    curve: list[dict] = []
    last: dict = {}
    start = time.monotonic()
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise SystemExit(f"earl-stream up exited early with code {proc.returncode}")
            time.sleep(0.5)
        client = P.ControlClient(json.loads(ready.read_text())["address"], timeout_s=10,
                                 secret=load_secret(str(secret)))
        while time.monotonic() - start < args.minutes * 60 and proc.poll() is None:
            time.sleep(args.every)
            try:
                s = json.loads(client.call(P.StatusRequest()).status_json)
            except EarlError:
                continue
            last = s
            point = {"t": round(time.monotonic() - start, 1), "step": s.get("policy_version"),
                     "reward": s.get("mean_reward_last"), "episodes": s.get("samples_produced")}
            curve.append(point)
            print(json.dumps(point), flush=True)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(600)
    return curve, last, time.monotonic() - start


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="training time budget")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps instead (0 = the budget)")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems (>= 200 for the reported number)")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between curve points")
    ap.add_argument("--quick", action="store_true", help="2 steps, 24 problems: checks the pipeline, not the goal")
    ap.add_argument("--json", default="bench/results/real_model.json")
    ap.add_argument("overrides", nargs="*", help="config overrides passed to `earl-stream up`")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.problems, args.every = 2, min(args.problems, 24), 10.0
        args.overrides = ["trainer.groups_per_step=2", "trainer.group_size=4", *args.overrides]
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_dir = out.parent / "real_model_run"
    path = model_dir()
    before = held_out(path, args.problems)
    print(f"held-out success before: {before.success:.3f} +- {before.stderr:.3f} ({before.problems} problems)")
    curve, status, wall = train(path, run_dir, args)
    run_s = status.get("wall_seconds") or 0.0
    produced, consumed = status.get("samples_produced", 0), status.get("samples_consumed", 0)
    tokens = status.get("tokens_produced", 0)  # prompt + generated tokens of every finished episode
    from earl_stream.workers.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    after = held_out(path, args.problems, ckpt) if ckpt is not None else None
    result = {
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
    out.write_text(json.dumps(result, indent=2))
    plot(curve, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k not in ("curve", "status")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
