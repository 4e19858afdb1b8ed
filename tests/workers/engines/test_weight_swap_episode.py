"""An episode whose turns, and tokens within one turn, span a weight update (rollout.weight_swap interrupt
and inplace): its sample carries both versions token by token, each token's behaviour log-prob is its own
version's, and the trainer masks exactly the tokens of the too-stale version (a real store and train step)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from earl_stream.algo.losses import token_logprobs
from earl_stream.config import AlgoConfig, TrainerConfig
from earl_stream.env import StepResult, env_options
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.records import SampleRecord
from earl_stream.store.client import ShardClient
from earl_stream.store.experience import ExperienceWriter
from earl_stream.store.layout import Layout
from earl_stream.store.node import ShardNode
from earl_stream.workers.agent_loop import Sampling, play_episode
from earl_stream.workers.engines import AsyncBatcher, GenerateRequest, GenerateResult, TorchEngine
from earl_stream.workers.engines.weight_swap import SwapMode, SwapTally, swap_weights
from earl_stream.workers.train_step import train_step

torch.set_num_threads(1)


class TwoTurns:
    """Two turns of up to 40 tokens; no reward logic needed."""

    max_turn_tokens = 40

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, seed: int) -> str:
        return "count to ten"

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        return StepResult("go on", 1.0, self.turn >= 2, {})


class SwapInTurn:
    """The rollout worker's batcher, with the weight swap started (through `swap_weights`, as the worker
    does) once the second turn has sampled 3 tokens."""

    def __init__(self, batcher: AsyncBatcher, engine: TorchEngine, state: dict[str, torch.Tensor], mode: SwapMode):
        self.batcher, self.engine, self.state, self.mode = batcher, engine, state, mode
        self.calls = 0
        self.tally = SwapTally(mode.value)
        self.swap: asyncio.Future[None] | None = None

    async def generate(self, request: GenerateRequest, **kw: Any) -> GenerateResult:
        self.calls += 1
        if self.calls == 2:
            loop, seen = asyncio.get_running_loop(), []

            def on_token(tok: int) -> None:
                seen.append(tok)
                if len(seen) == 3:
                    loop.call_soon_threadsafe(self._start)
                    # The engine thread waits (here, between two steps) until the swap is staged: on a busy machine
                    # the turn's last 37 tokens could otherwise be decoded before the event loop starts the swap.
                    deadline = time.monotonic() + 60.0
                    while not self.engine._swapper.pending and self.engine.policy_version == 0 \
                            and time.monotonic() < deadline:
                        time.sleep(0.001)

            request = dataclasses.replace(request, on_token=on_token)
        return await self.batcher.generate(request, **kw)

    def _start(self) -> None:
        self.swap = asyncio.ensure_future(swap_weights(self.batcher, self.engine, self.state, 1, self.mode, self.tally))

    def release(self, key: str) -> None:
        self.batcher.release(key)


def _episode(model_dir: Path, mode: SwapMode) -> tuple[SampleRecord, SwapTally]:
    model, tokenizer = load_model(model_dir)
    new, _ = load_model(model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    engine = TorchEngine(model.eval(), weight_swap=mode)
    env = TwoTurns()

    async def go() -> tuple[SampleRecord, SwapTally]:
        batcher = AsyncBatcher(engine)
        shim = SwapInTurn(batcher, engine, new.state_dict(), mode)
        try:
            record = await play_episode(env, env_options(env), ChatFormat(tokenizer), shim,  # type: ignore[arg-type]
                                        env_name="two", seed=0, prompt_ordinal=0, group_id="g0",
                                        sampling=Sampling(temperature=0.0), policy_version=lambda: -5,
                                        decode=tokenizer.decode)
            assert shim.swap is not None
            await shim.swap
            return record, shim.tally
        finally:
            await batcher.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("mode", [SwapMode.INTERRUPT, SwapMode.INPLACE])
def test_an_episode_spanning_a_swap_is_trained_token_by_token(tiny_model_dir: Path, mode: SwapMode) -> None:
    record, tally = _episode(tiny_model_dir, mode)
    mask, versions = record.loss_mask.astype(bool), record.policy_version
    turns = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8)])) == 1)  # first token of each turn
    assert len(turns) == 2 and tally.swaps == 1
    second = versions[turns[1]:][mask[turns[1]:]]
    assert set(versions[:turns[1]][mask[:turns[1]]]) == {0}  # turn 1: all old
    assert second[0] == 0 and second[-1] == 1 and set(second) == {0, 1}  # turn 2 spans the swap
    assert np.all(np.diff(second) >= 0) and np.all(versions[~mask] == -1)
    if mode is SwapMode.INTERRUPT:
        assert tally.last_reprefill_tokens == turns[1] + int((second == 0).sum())
    # each token's behaviour log-prob is the one its own version gave (interrupt: the new weights over the
    # whole context; the old ones for tokens sampled before)
    if mode is SwapMode.INTERRUPT:
        old, _ = load_model(tiny_model_dir)
        new, _ = load_model(tiny_model_dir)
        with torch.no_grad():
            for p in new.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
            ids = torch.from_numpy(record.input_ids.astype(np.int64))[None]
            by_version = {0: token_logprobs(old(input_ids=ids).logits, ids)[0], 1: token_logprobs(new(input_ids=ids).logits, ids)[0]}
        second_turn = np.flatnonzero(mask)[np.flatnonzero(mask) >= turns[1]]
        want = [float(by_version[int(versions[i])][i]) for i in second_turn]
        assert record.behaviour_logprobs[second_turn].tolist() == pytest.approx(want, abs=1e-4)

    with ShardNode("127.0.0.1") as node:
        client = ShardClient(timeout_s=10)
        try:
            metas = ExperienceWriter(node, "w").put([record])
            assert metas[0].policy_version_min == 0 and metas[0].policy_version_max == 1
            model, _ = load_model(tiny_model_dir)
            result = train_step(model.train(), torch.optim.SGD(model.parameters(), lr=0.0), metas, Layout(), client,
                                TrainerConfig(), algo=AlgoConfig(), min_version=1)
        finally:
            client.close()
    old_tokens = int(((versions == 0) & mask).sum())
    assert 0 < old_tokens < int(mask.sum())
    assert result.stale_frac == pytest.approx(old_tokens / int(mask.sum()))
