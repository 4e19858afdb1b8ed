"""The agent loop with the real built-in engine: token-in/token-out records, and environments that
crash, hang or misbehave failing only their own episode."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import torch
from earl_stream_envs.tictactoe import TicTacToe

from earl_stream.env import StepResult, env_options
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.workers.agent_loop import EpisodeFailed, Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine


class Raises:
    async def reset(self, seed: int) -> str:
        return "go"

    async def step(self, action_text: str) -> StepResult:
        raise ZeroDivisionError("boom")


class Hangs:
    async def reset(self, seed: int) -> str:
        return "go"

    async def step(self, action_text: str) -> StepResult:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


class WrongType:
    def reset(self, seed: int) -> str:  # synchronous methods are accepted
        return "go"

    def step(self, action_text: str) -> Any:
        return ("obs", 1.0, True)  # a bare tuple, not a StepResult


def _play(model_dir: Path, envs: list[Any], timeout: float = 30.0) -> list[Any]:
    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir)
    chat = ChatFormat(tokenizer)
    engine = TorchEngine(model.eval(), seed=0)

    async def go() -> list[Any]:
        batcher = AsyncBatcher(engine)
        try:
            return await asyncio.gather(*[
                play_episode(env, env_options(env), chat, batcher, env_name=type(env).__name__, seed=i,
                             prompt_ordinal=i, group_id=f"g{i}", sampling=Sampling(), policy_version=lambda: 7,
                             decode=tokenizer.decode, step_timeout_s=timeout)
                for i, env in enumerate(envs)], return_exceptions=True)
        finally:
            await batcher.aclose()

    return asyncio.run(go())


def test_token_in_token_out_record(tiny_model_dir: Path) -> None:
    [record] = _play(tiny_model_dir, [TicTacToe()])
    mask = record.loss_mask.astype(bool)
    assert record.turns >= 1 and mask.sum() >= 1 and not mask[: record.prompt_tokens].any()
    assert np.all(record.policy_version[mask] >= 0) and np.all(record.policy_version[~mask] == -1)
    assert np.all(record.behaviour_logprobs[mask] <= 0) and np.all(record.behaviour_logprobs[~mask] == 0)
    assert record.info["outcome"] in {"win", "loss", "draw", "illegal"}


def test_bad_environments_fail_only_their_own_episode(tiny_model_dir: Path) -> None:
    results = _play(tiny_model_dir, [Raises(), Hangs(), WrongType(), TicTacToe()], timeout=2.0)
    assert isinstance(results[0], EpisodeFailed) and "ZeroDivisionError" in str(results[0])
    assert isinstance(results[1], EpisodeFailed) and "longer than" in str(results[1])
    assert isinstance(results[2], EpisodeFailed) and "StepResult" in str(results[2])
    assert results[3].env == "TicTacToe" and results[3].num_tokens > 0
