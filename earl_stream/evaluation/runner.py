"""Plays held-out items through the engine and the agent loop RL uses (`workers.agent_loop.play_episode`
over an `AsyncBatcher`), and the whole evaluation of a model in one process (`evaluate`, for
`earl-stream eval` and `bench/heldout.py`).

An item's sample `s` resets the environment with the item's seed and, at a temperature above 0, samples
with the engine's per-request seed `episode_sample_seed(seed, s)` (as a training group's episodes do), so
an evaluation is reproducible; at temperature 0 decoding is greedy. An episode whose environment or
engine fails counts as a failure (outcome "failed"), never as a crash of the evaluation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from earl_stream.env import make_env
from earl_stream.env.tools import with_tools
from earl_stream.errors import EngineError, EnvError
from earl_stream.evaluation.heldout import HeldOutSet
from earl_stream.evaluation.passk import EpisodeOutcome, EvalSummary, summarize
from earl_stream.model.chat import ChatFormat
from earl_stream.workers.agent_loop import EpisodeFailed, Sampling, episode_sample_seed, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher

Progress = Callable[[int, int], None]  # (episodes done, episodes in all)


@dataclasses.dataclass(frozen=True)
class ItemSpec:
    """What one evaluation episode plays: `sample` of the item reset with `seed` of `spec` built with `params`."""

    spec: str
    params: dict[str, Any]
    item: int
    seed: int
    sample: int
    temperature: float
    success_outcomes: tuple[str, ...]
    name: str = "eval"


async def play_item(it: ItemSpec, batcher: AsyncBatcher, chat: ChatFormat, decode: Callable[[list[int]], object], *,
                    policy_version: Callable[[], int] = lambda: 0, max_episode_tokens: Callable[[], int] | None = None,
                    step_timeout_s: float = 120.0,
                    make: Callable[[ItemSpec], Awaitable[Any]] | None = None) -> tuple[EpisodeOutcome, str]:
    """One evaluation episode: its outcome and the model's reply text (its own tokens, decoded). `make` builds the
    item's environment (a rollout worker's: in its sandbox where the code comes from outside this project); by
    default it is made in this process."""
    sample_seed = None if it.temperature <= 0 else episode_sample_seed(it.seed, it.sample)
    try:
        env = await make(it) if make is not None else with_tools(make_env(it.spec, it.params))
        record = await play_episode(env, None, chat, batcher, env_name=it.name, seed=it.seed,
                                    prompt_ordinal=-1, group_id=f"eval-{it.name}-{it.item}",
                                    sampling=Sampling(temperature=it.temperature), policy_version=policy_version,
                                    decode=decode, step_timeout_s=step_timeout_s, sample_seed=sample_seed,
                                    max_episode_tokens=max_episode_tokens)
    except (EpisodeFailed, EnvError, EngineError) as exc:
        return EpisodeOutcome(it.item, it.sample, 0.0, False, "failed"), f"(failed: {exc})"
    outcome = str(record.info.get("outcome", ""))
    versions = [int(v) for v, m in zip(record.policy_version, record.loss_mask) if m]
    reply = decode([int(t) for t, m in zip(record.input_ids, record.loss_mask) if m])
    return EpisodeOutcome(it.item, it.sample, float(record.reward), outcome in it.success_outcomes, outcome,
                          record.response_tokens, min(versions) if versions else -1), str(reply)


def item_specs(held: HeldOutSet, samples: int, temperature: float) -> list[ItemSpec]:
    """Every (item, sample) episode of an evaluation, item-major."""
    return [ItemSpec(held.spec, held.params, i, seed, s, temperature, held.success_outcomes, held.name)
            for i, seed in enumerate(held.seeds) for s in range(samples)]


@dataclasses.dataclass(frozen=True)
class EvalRun:
    """An evaluation's summary, its episodes, a few replies, and its wall time (seconds)."""

    summary: EvalSummary
    episodes: list[EpisodeOutcome]
    examples: list[dict[str, Any]]
    seconds: float


def evaluate(model: Any, tokenizer: Any, held: HeldOutSet, *, samples: int = 1, temperature: float = 0.0,
             batch: int = 32, progress: Progress | None = None) -> EvalRun:
    """Evaluate `model` (a Hugging Face causal LM) on `held` in this process with the built-in engine."""
    from earl_stream.workers.engines.torch_engine import TorchEngine

    specs = item_specs(held, samples, temperature)
    start = time.monotonic()

    async def run() -> list[tuple[EpisodeOutcome, str]]:
        engine = TorchEngine(model, max_batch_size=batch)
        batcher = AsyncBatcher(engine, max_batch_size=batch, max_wait_s=0.05)
        chat = ChatFormat(tokenizer)
        limit = asyncio.Semaphore(batch)
        done = 0

        async def one(it: ItemSpec) -> tuple[EpisodeOutcome, str]:
            nonlocal done
            async with limit:
                out = await play_item(it, batcher, chat, tokenizer.decode)
            done += 1
            if progress is not None:
                progress(done, len(specs))
            return out

        try:
            return list(await asyncio.gather(*[one(it) for it in specs]))
        finally:
            batcher.close()

    played = asyncio.run(run())
    episodes = [e for e, _ in played]
    examples = [{"item": e.item, "sample": e.sample, "reply": reply, "outcome": e.outcome} for e, reply in played[:6]]
    return EvalRun(summarize(episodes), episodes, examples, round(time.monotonic() - start, 1))
