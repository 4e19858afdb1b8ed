"""The contract every environment of the library honours, run on each of them through the registry.

reset returns a str (or an Observation: text and images); step returns a StepResult (float reward, JSON-able info, "outcome" on the
terminal step); an episode ends within MAX_STEPS arbitrary replies; the same seed gives the same
first observation and, with the same replies, the same episode; stepping a finished episode raises
EnvError. Third-party adapters skip cleanly when their package is not installed.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from earl_stream.env import Observation, StepResult, env_options, env_reset, env_step, make_env
from earl_stream.env.tools import ToolEnv
from earl_stream.errors import EnvError

MAX_STEPS = 100
SEEDS = range(8)

# (registry name, constructor params, package the adapter needs or None)
LIBRARY: list[tuple[str, dict[str, Any], str | None]] = [
    ("tictactoe", {}, None),
    ("connect_four", {}, None),
    ("tictactoe_image", {}, None),
    ("connect_four_image", {}, None),
    ("calculator", {}, None),
    ("long_recall", {}, None),
    ("long_recall", {"turns": 5, "grow_every": 1}, None),
    ("tictactoe_match", {}, None),
    ("tictactoe_match", {"games": 3, "grow_every": 1}, None),
    ("reasoning_gym", {"task": "basic_arithmetic", "size": 100}, "reasoning_gym"),
    ("reasoning_gym", {"task": "chain_sum", "size": 100, "max_attempts": 3}, "reasoning_gym"),
    ("textarena", {"game": "TicTacToe-v0"}, "textarena"),
    ("textarena", {"game": "ConnectFour-v0", "model_player": "random"}, "textarena"),
    ("gymnasium", {"id": "Taxi-v3"}, "gymnasium"),
    ("gymnasium", {"id": "FrozenLake-v1"}, "gymnasium"),
]

# Replies that are moves, answers, tool calls (good and bad) and noise for the environments above.
REPLIES = [str(d) for d in range(1, 10)] + [
    "[4]", "[col 2]", "answer: 12", "<answer>7</answer>", "hello", "", "<tool>{oops}</tool>",
    '<tool>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool>',
]


def _ids(case: tuple[str, dict[str, Any], str | None]) -> str:
    name, params, _ = case
    return name + "".join(f"-{v}" for v in params.values())


def build(name: str, params: dict[str, Any], package: str | None) -> object:
    if package is not None:
        pytest.importorskip(package)
    return make_env(name, params)


async def episode(env: object, seed: int, replies: random.Random) -> list[tuple[str, StepResult]]:
    trace: list[tuple[str, StepResult]] = []
    observation = await env_reset(env, seed)
    assert isinstance(observation, (str, Observation))
    for _ in range(MAX_STEPS):
        reply = replies.choice(REPLIES)
        result = await env_step(env, reply)
        assert isinstance(result.observation, (str, Observation)) and isinstance(result.reward, float)
        assert isinstance(result.done, bool) and isinstance(result.info, dict)
        json.dumps(result.info)
        trace.append((reply, result))
        if result.done:
            assert isinstance(result.info.get("outcome"), str)
            return [("", StepResult(observation, 0.0, False)), *trace]
    pytest.fail(f"{type(env).__name__} did not finish within {MAX_STEPS} replies (seed {seed})")


@pytest.mark.parametrize("case", LIBRARY, ids=_ids)
def test_library_environment_contract(case: tuple[str, dict[str, Any], str | None]) -> None:
    env = build(*case)
    env_options(env)  # the optional attributes are well-typed

    async def go() -> None:
        for seed in SEEDS:
            first = await episode(env, seed, random.Random(seed))
            again = await episode(build(*case), seed, random.Random(seed))
            assert again == first, f"seed {seed} did not replay"
            with pytest.raises(EnvError):
                await env_step(env, "1")

    asyncio.run(go())


def test_tool_env_wrapper_honours_the_contract() -> None:
    from earl_stream_envs.calculator import CALCULATOR_TOOL
    from earl_stream_envs.tictactoe import TicTacToe

    async def go() -> None:
        for seed in SEEDS:
            env = ToolEnv(TicTacToe(), tools=[CALCULATOR_TOOL], max_tool_calls=2)
            first = await episode(env, seed, random.Random(seed))
            again = await episode(ToolEnv(TicTacToe(), tools=[CALCULATOR_TOOL], max_tool_calls=2), seed,
                                  random.Random(seed))
            assert again == first
            with pytest.raises(EnvError):
                await env_step(env, "1")

    asyncio.run(go())
