"""Held-out evaluation of a model on a reasoning-gym task: greedy, through the built-in engine and the agent
loop (the exact rendering and stopping that RL sees), on problems the training environment never poses.

    python bench/heldout.py MODEL_DIR --problems 200 [--config configs/X.yaml | --params JSON] [--json out.json]

A thin caller of `earl_stream.evaluation` (what `earl-stream eval` runs): the held-out set is
`ReasoningGymEnv.held_out` (another dataset seed, every question of the training dataset removed), so none
of them can ever be trained on. Success is exact: the episode's outcome is "correct" (score 1.0). Prints
success with its binomial standard error.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch

from earl_stream.evaluation.heldout import held_out_set
from earl_stream.evaluation.runner import evaluate as run_evaluation
from earl_stream.model import load_model

__all__ = ["HeldOut", "evaluate", "held_out_params"]


@dataclass(frozen=True)
class HeldOut:
    """Result of `evaluate`: success (fraction correct), stderr (binomial), problems, seconds, replies (a few)."""

    success: float
    stderr: float
    problems: int
    outcomes: dict[str, int]
    seconds: float
    generated_tokens: int
    examples: list[dict[str, Any]]


def held_out_params(params: dict[str, Any], problems: int, spec: str = "reasoning_gym") -> tuple[dict[str, Any], list[int]]:
    """Env params of the held-out set and the seeds (item indices) of `problems` questions not in training."""
    held = held_out_set(spec, params, problems)
    return held.params, list(held.seeds)


def evaluate(model: Any, tokenizer: Any, params: dict[str, Any], problems: int = 200, batch: int = 32,
             spec: str = "reasoning_gym") -> HeldOut:
    """Greedy success of `model` on `problems` held-out questions of the task in `params` (ReasoningGymEnv's)."""
    run = run_evaluation(model, tokenizer, held_out_set(spec, params, problems), samples=1, temperature=0.0,
                         batch=batch)
    s = run.summary
    return HeldOut(success=s.success, stderr=s.stderr, problems=s.problems, outcomes=s.outcomes, seconds=run.seconds,
                   generated_tokens=s.generated_tokens, examples=[{k: e[k] for k in ("reply", "outcome")}
                                                                  for e in run.examples])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--config", help="a run config whose first environment is a reasoning_gym one: its params")
    ap.add_argument("--params", default="{}", help="ReasoningGymEnv params as JSON (task, config, size, ...)")
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_dir)
    params = json.loads(args.params)
    if args.config:
        from earl_stream.config import load_config

        params = {**load_config(args.config).envs[0].params, **params}
    result = evaluate(model, tokenizer, params, args.problems, args.batch)
    out = {"params": params, **result.__dict__}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
