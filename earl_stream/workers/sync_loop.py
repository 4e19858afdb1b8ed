"""The synchronous reference loop: generate a step's episodes, train on them, load the new weights,
generate again, in one process.

It is what the asynchronous pipeline reduces to at `trainer.max_staleness=0`, built from the very
same parts: the supervisor's prompt ledger (same ordinals, seeds and claims), the rollout worker's
engine and agent loop (seeded per episode), the experience store (a shard node in this process) and
the trainer's `train_step`. It owns nothing but the order in which they run; it exists as the
golden reference of `tests/test_sync_invariant.py` and as the simplest baseline a benchmark can show.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import torch

from earl_stream.config import RunConfig
from earl_stream.env import seeds_per_episode
from earl_stream.errors import EarlError
from earl_stream.model.chat import ChatFormat
from earl_stream.model.loading import load_model, torch_dtype
from earl_stream.protocol import Prompt
from earl_stream.records import SampleRecord
from earl_stream.store.client import ShardClient
from earl_stream.store.experience import ExperienceWriter
from earl_stream.store.layout import Layout
from earl_stream.store.node import ShardNode
from earl_stream.store.schema import table_from_ipc, table_to_metas
from earl_stream.supervisor.ledger import Ledger
from earl_stream.workers.agent_loop import Sampling, episode_env_seed, episode_sample_seed, play_episode
from earl_stream.workers.common import model_path
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.registry import make_engine
from earl_stream.workers.env_runner import episode_envs, open_env_runners
from earl_stream.workers.train_step import StepResult, train_step

log = logging.getLogger(__name__)
_WORKER = "sync-loop"


@dataclasses.dataclass
class SyncStep:
    """One step of the loop: the trainer's result plus what the rollout half did and how long each took."""

    step: int
    result: StepResult
    generate_seconds: float
    train_seconds: float
    generated_tokens: int
    outcomes: dict[str, int]


class SyncLoop:
    """generate -> train -> load weights -> generate, for `cfg.steps` steps (or `run(steps)`).

    The trainer's model is loaded after `torch.manual_seed(cfg.seed)`, as a trainer rank does; the
    engine holds its own copy (as a rollout worker does) and receives every new version by state dict.
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        path = model_path(cfg)
        torch.manual_seed(cfg.seed)
        self.model, self.tokenizer = load_model(path)
        self.model.train()
        engine_model, _ = load_model(path, dtype=torch_dtype(cfg.rollout.dtype))
        engine_model.eval()
        # batched as the pipeline's engine would be under the same config (rollout.batch_invariant)
        invariant = dataclasses.replace(cfg.rollout, engine="torch").invariant_batches(cfg.trainer.max_staleness)
        self.engine = make_engine("torch", path, engine_model, max_batch_size=cfg.rollout.max_batch_size,
                                  seed=cfg.seed, batch_invariant=invariant)
        self.ref_model = None
        if cfg.algo.kl_coef > 0:  # the reference policy: the initial weights, as a trainer rank loads it
            self.ref_model, _ = load_model(path)
            self.ref_model.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.trainer.lr,
                                           weight_decay=cfg.trainer.weight_decay)
        self.chat = ChatFormat(self.tokenizer)
        t = cfg.trainer
        self.ledger = Ledger(cfg.envs, seed=cfg.seed, group_size=t.group_size, groups_per_step=t.groups_per_step,
                             max_staleness=0, dynamic_sampling=cfg.algo.dynamic_sampling)
        self.node = ShardNode("127.0.0.1")
        self.writer = ExperienceWriter(self.node, _WORKER)
        self.client = ShardClient()
        self.envs = {e.display_name: e for e in cfg.envs}
        self.env_runners = open_env_runners(cfg, _WORKER)  # environments from outside this project run sandboxed
        self.sampling = Sampling(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)

    def run(self, steps: int | None = None) -> list[SyncStep]:
        """Run `steps` steps (default `cfg.steps`) and return one `SyncStep` per step."""
        try:
            return asyncio.run(self._run(steps if steps is not None else self.cfg.steps))
        finally:
            self.close()

    async def _run(self, steps: int) -> list[SyncStep]:
        batcher = AsyncBatcher(self.engine, max_batch_size=self.cfg.rollout.max_batch_size,
                               join_running=self.cfg.rollout.join_running_batch)
        out: list[SyncStep] = []
        try:
            for step in range(steps):
                start = time.monotonic()
                ipc: bytes | None = None
                groups: list[list[SampleRecord]] = []
                while ipc is None:  # more than one round only when dynamic sampling dropped groups
                    if len(groups) > 100 * self.cfg.trainer.groups_per_step:
                        raise EarlError(f"step {step}: {len(groups)} groups played and every one had equal rewards, "
                                        "which algo.dynamic_sampling drops: nothing to learn from")
                    prompts = self.ledger.issue(_WORKER, self.cfg.trainer.groups_per_step)
                    played = await asyncio.gather(*[self._play_group(batcher, p) for p in prompts])
                    for records in played:
                        self.ledger.add_rows(_WORKER, self.writer.put(records))
                    groups.extend(played)
                    ipc, dropped = self.ledger.claim(step, self.cfg.trainer.groups_per_step, min_policy_version=step)
                    self.writer.free([sid for ids in dropped.values() for sid in ids])
                generated = time.monotonic()
                metas = table_to_metas(table_from_ipc(ipc))
                result = train_step(self.model, self.optimizer, metas, Layout(dp_size=1, dp_rank=0), self.client,
                                    self.cfg.trainer, algo=self.cfg.algo, step=step, run_steps=self.cfg.steps,
                                    ref_model=self.ref_model, temperature=self.cfg.rollout.temperature)
                self.writer.free([m.sample_id for m in metas])
                self.ledger.release(step)
                state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                self.engine.load_state_dict(state, step + 1)
                done = time.monotonic()
                outcomes: dict[str, int] = {}
                for records in groups:
                    for r in records:
                        key = str(r.info.get("outcome", ""))
                        outcomes[key] = outcomes.get(key, 0) + 1
                out.append(SyncStep(step, result, generated - start, done - generated,
                                    sum(r.response_tokens for g in groups for r in g), outcomes))
                log.info("sync step %d: loss %.6f reward %.3f (%d samples, %d tokens), generate %.2fs train %.2fs",
                         step, result.loss, result.mean_reward, result.samples, result.tokens, generated - start,
                         done - generated)
        finally:
            batcher.close()
            if self.env_runners is not None:
                await self.env_runners.aclose()
        return out

    async def _play_group(self, batcher: AsyncBatcher, prompt: Prompt) -> list[SampleRecord]:
        spec = self.envs[prompt.env]
        envs = await episode_envs(self.env_runners, spec, prompt.group_size)  # sandboxed where they must be
        return list(await asyncio.gather(*[
            play_episode(env, None, self.chat, batcher, env_name=prompt.env,  # options read after the reset
                         seed=episode_env_seed(prompt.seed, i, seeds_per_episode(spec.group_seed, env)),
                         prompt_ordinal=prompt.prompt_ordinal, group_id=prompt.group_id, sampling=self.sampling,
                         policy_version=lambda: self.engine.policy_version, decode=self.tokenizer.decode,
                         sample_seed=episode_sample_seed(prompt.seed, i))
            for i, env in enumerate(envs)]))

    def close(self) -> None:
        self.client.close()
        self.node.close()


def run_sync_loop(cfg: RunConfig, steps: int | None = None) -> list[SyncStep]:
    """Build a `SyncLoop` for `cfg` and run it; the losses are `[s.result.loss for s in ...]`."""
    return SyncLoop(cfg).run(steps)
