"""Evaluation episodes on a rollout worker: the `EvalTask`s the supervisor hands out between training groups
(`supervisor.eval_rounds`) are played through the worker's own engine batcher and agent loop, and only their
results go back (`PutEval`): no sample record is kept, put in the store or sent as a metadata row, so none
can ever be trained on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.evaluation.runner import ItemSpec, play_item
from earl_stream.model.chat import ChatFormat
from earl_stream.workers.engines.batcher import AsyncBatcher


async def play_eval_tasks(tasks: list[P.EvalTask], batcher: AsyncBatcher, chat: ChatFormat,
                          decode: Callable[[list[int]], object], *, worker_id: str, policy_version: Callable[[], int],
                          max_episode_tokens: Callable[[], int],
                          make: Callable[[ItemSpec], Awaitable[Any]] | None = None) -> list[P.EvalResult]:
    """Play `tasks` concurrently (batched with the worker's training episodes) and return their results. `make`
    builds an item's environment (`runner.play_item`)."""

    async def one(t: P.EvalTask) -> P.EvalResult:
        it = ItemSpec(t.spec, json.loads(t.params_json), t.item, t.seed, t.sample, t.temperature,
                      tuple(t.success_outcomes), t.env)
        e, _ = await play_item(it, batcher, chat, decode, policy_version=policy_version,
                               max_episode_tokens=max_episode_tokens, make=make)
        M.EVAL_EPISODES.labels(worker_id, t.env, e.outcome).inc()
        return P.EvalResult(task_id=t.task_id, reward=e.reward, success=e.success, outcome=e.outcome,
                            tokens=e.tokens, policy_version=e.policy_version)

    return list(await asyncio.gather(*[one(t) for t in tasks]))
