"""Held-out evaluation of a model on a reasoning-gym task: greedy, through the built-in engine and the agent
loop (the exact rendering and stopping that RL sees), on problems the training environment never poses.

    python bench/heldout.py MODEL_DIR --problems 200 [--config configs/X.yaml | --params JSON] [--json out.json]

The training environment poses item `seed % size` of the dataset built with its `dataset_seed`; the
held-out set is built with another dataset seed and keeps only questions that are not in the training
dataset, so none of them can ever be trained on. Success is exact: the episode's outcome is "correct"
(score 1.0). Prints success with its binomial standard error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from earl_stream.env import env_options, make_env
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.workers.agent_loop import Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

HELD_OUT_DATASET_SEED = 987_654_321


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


def held_out_params(params: dict[str, Any], problems: int) -> tuple[dict[str, Any], list[int]]:
    """Env params of the held-out set and the seeds (item indices) of `problems` questions not in training."""
    import reasoning_gym

    task, config = params.get("task", "basic_arithmetic"), dict(params.get("config") or {})
    train = reasoning_gym.create_dataset(task, seed=int(params.get("dataset_seed", 0)),
                                         size=int(params.get("size", 10_000)), **config)
    seen = {item["question"] for item in train}
    size = problems * 50  # small tasks repeat questions: draw until `problems` unseen ones (items are made lazily)
    held = reasoning_gym.create_dataset(task, seed=HELD_OUT_DATASET_SEED, size=size, **config)
    seeds, questions = [], set()
    for i in range(size):
        q = held[i]["question"]
        if q not in seen and q not in questions:
            seeds.append(i)
            questions.add(q)
        if len(seeds) == problems:
            break
    if len(seeds) < problems:
        raise SystemExit(f"only {len(seeds)} held-out questions differ from the training set; widen the task")
    return {**params, "dataset_seed": HELD_OUT_DATASET_SEED, "size": size}, seeds


async def _play_all(model: Any, tokenizer: Any, spec: str, params: dict[str, Any], seeds: list[int],
                    batch: int) -> list[Any]:
    engine = TorchEngine(model, max_batch_size=batch)
    batcher = AsyncBatcher(engine, max_batch_size=batch, max_wait_s=0.05)
    chat = ChatFormat(tokenizer)
    limit = asyncio.Semaphore(batch)

    async def one(seed: int) -> Any:
        async with limit:
            env = make_env(spec, params)
            return await play_episode(env, env_options(env), chat, batcher, env_name="eval", seed=seed,
                                      prompt_ordinal=seed, group_id="eval", sampling=Sampling(temperature=0.0),
                                      policy_version=lambda: 0, decode=tokenizer.decode, step_timeout_s=120)

    try:
        return list(await asyncio.gather(*[one(s) for s in seeds]))
    finally:
        batcher.close()


def evaluate(model: Any, tokenizer: Any, params: dict[str, Any], problems: int = 200, batch: int = 32,
             spec: str = "reasoning_gym") -> HeldOut:
    """Greedy success of `model` on `problems` held-out questions of the task in `params` (ReasoningGymEnv's)."""
    eval_params, seeds = held_out_params(params, problems)
    start = time.monotonic()
    records = asyncio.run(_play_all(model, tokenizer, spec, eval_params, seeds, batch))
    outcomes: dict[str, int] = {}
    for r in records:
        key = str(r.info.get("outcome", ""))
        outcomes[key] = outcomes.get(key, 0) + 1
    p = outcomes.get("correct", 0) / len(records)
    examples = [{"reply": tokenizer.decode([int(t) for t, m in zip(r.input_ids, r.loss_mask) if m]),
                 "outcome": r.info.get("outcome")} for r in records[:6]]
    return HeldOut(success=p, stderr=math.sqrt(p * (1 - p) / len(records)), problems=len(records),
                   outcomes=outcomes, seconds=round(time.monotonic() - start, 1),
                   generated_tokens=int(sum(int(r.loss_mask.sum()) for r in records)), examples=examples)


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
