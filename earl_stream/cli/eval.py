"""`earl-stream eval --model DIR_OR_CHECKPOINT --env SPEC`: success, pass@k and mean reward of a model on
held-out items of an environment (`earl_stream.evaluation`), played through the built-in engine and the
agent loop RL uses, with a progress bar on stderr and a summary on stdout (`--json`: the result as JSON
on stdout instead, the summary on stderr; `--out FILE`: the result written there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from earl_stream.cli.flags import add_output_args, add_param_args, output_of, params_of
from earl_stream.errors import ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate a model or checkpoint on held-out items of an environment",
                       description="Play held-out items of an environment (items its training set never poses; "
                                   "for an environment without a held-out set, such as a game, seeds no run issues "
                                   "for training) with the model, through the engine and agent loop RL uses; print "
                                   "success, pass@k (k = 1..samples, unbiased estimator), a game's win, draw and "
                                   "loss rates, and mean reward.")
    p.add_argument("--model", required=True, metavar="DIR_OR_CHECKPOINT", help="a Hugging Face model directory, a "
                   "run directory (its latest checkpoint), or a trainer checkpoint (dense, sharded or LoRA)")
    p.add_argument("--env", required=True, metavar="SPEC", help="environment spec (e.g. reasoning_gym), or with "
                   "--config the name of one of the run's environments")
    add_param_args(p, "the environment's training params as one JSON object (the held-out items are those these "
                   "params never pose); merged over --config's, and --param over it")
    p.add_argument("--config", metavar="PATH", help="a run config: the environment named --env (or the first one "
                   "with that spec) gives spec and params")
    p.add_argument("--problems", type=int, default=200, metavar="N", help="held-out items (default 200)")
    p.add_argument("--samples", type=int, default=1, metavar="K", help="episodes per item; pass@k for k = 1..K")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (0 = greedy)")
    p.add_argument("--batch", type=int, default=32, help="concurrent episodes (engine batch)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--base", default="", metavar="DIR", help="base model of a LoRA checkpoint whose recorded base "
                   "path is not a directory here")
    add_output_args(p, "the result (summary, pass@k, outcomes, seeds, a few replies)")


def _env_of(args: argparse.Namespace) -> tuple[str, str, dict[str, Any]]:
    """(name, spec, training params) from --env, --config and --params."""
    params = params_of(args)
    if not args.config:
        return args.env.rsplit(":", 1)[-1].lower(), args.env, params
    from earl_stream.config import load_config

    envs = load_config(args.config).envs
    spec = next((e for e in envs if e.display_name == args.env), None) or next((e for e in envs if e.spec == args.env), None)
    if spec is None:
        raise ConfigError(f"--env {args.env!r} names none of the environments of {args.config}: "
                          f"{[e.display_name for e in envs]}")
    return spec.display_name, spec.spec, {**spec.params, **params}


def _check(args: argparse.Namespace) -> None:
    bad = [f"--{k} must be >= {lo}, got {getattr(args, k)}" for k, lo in
           (("problems", 1), ("samples", 1), ("batch", 1), ("threads", 1), ("temperature", 0)) if getattr(args, k) < lo]
    if args.samples > 1 and args.temperature <= 0:
        bad.append(f"--samples {args.samples} at --temperature 0 plays every item the same greedy way: pass@k>1 "
                   "needs a temperature above 0")
    if bad:
        raise ConfigError("; ".join(bad))


def summary_lines(name: str, model: str, result: dict[str, Any]) -> list[str]:
    """The human summary of an evaluation result (`run_eval`'s JSON)."""
    passk = "  ".join(f"pass@{k} {v:.3f}" for k, v in result["pass_at_k"].items())
    outcomes = ", ".join(f"{k or '-'} {v}" for k, v in sorted(result["outcomes"].items()))
    items = ("evaluation seeds (never issued for training)" if result.get("items") == "eval_seeds"
             else "held-out items")
    game = ([f"  win {result['win_rate']:.3f}  draw {result['draw_rate']:.3f}  loss {result['loss_rate']:.3f}"]
            if result.get("win_rate") is not None else [])
    return [f"eval of {model} on {result['problems']} {items} of {name} x {result['samples']} samples "
            f"(temperature {result['temperature']:g}), {result['seconds']:.1f}s:",
            f"  success     {result['success']:.3f} +- {result['stderr']:.3f}",
            f"  {passk}",
            *game,
            f"  mean reward {result['mean_reward']:.3f}",
            f"  outcomes    {outcomes}"]


def run_eval(args: argparse.Namespace) -> int:
    import torch

    from earl_stream.evaluation.heldout import held_out_set
    from earl_stream.evaluation.models import load_for_eval
    from earl_stream.evaluation.runner import evaluate
    from earl_stream.progress import progress

    _check(args)
    to_stdout, out = output_of(args, "eval")
    name, spec, params = _env_of(args)
    held = held_out_set(spec, params, args.problems, name)  # refused with its reason before the model loads
    torch.set_num_threads(args.threads)
    loaded = load_for_eval(args.model, base=args.base)
    with progress(f"eval {name}", len(held.seeds) * args.samples, "episodes") as bar:
        run = evaluate(loaded.model, loaded.tokenizer, held, samples=args.samples, temperature=args.temperature,
                       batch=args.batch, progress=lambda done, total: bar.update(done, total))
    result = {"model": str(loaded.path), "model_kind": loaded.kind, "env": name, "spec": spec, "params": params,
              "heldout_params": held.params, "items": held.items, "seeds": list(held.seeds),
              "temperature": args.temperature,
              **run.summary.to_dict(), "seconds": run.seconds, "examples": run.examples}
    print("\n".join(summary_lines(name, f"{loaded.kind} {loaded.path}", result)),
          file=sys.stderr if to_stdout else sys.stdout)
    if to_stdout:
        print(json.dumps(result, indent=2))
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
        print(f"  written to {out}", file=sys.stderr)
    return 0
