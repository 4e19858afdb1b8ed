"""The Gymnasium adapter against the real gymnasium package: text/ANSI observations, actions parsed
from text, any discrete-action id, and an episode played by the built-in engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from earl_stream_envs.gymnasium_env import ansi_to_text

from earl_stream.env import make_env
from earl_stream.errors import EnvError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.workers.agent_loop import Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

pytest.importorskip("gymnasium", reason="the gymnasium package is not installed (pip install 'earl_stream[envs]')")


def test_frozen_lake_is_solved_by_named_and_numbered_actions() -> None:
    env = make_env("gymnasium", {"id": "FrozenLake-v1", "is_slippery": False})

    async def go() -> None:
        first = await env.reset(0)
        assert first.splitlines()[0] == "[S]FFF"  # the player's cell is marked
        replies = ["down", "I pick 1", "right", "2", "move Down now", "right!"]
        results = [await env.step(r) for r in replies]
        assert [r.done for r in results] == [False] * 5 + [True]
        assert results[-1].reward == 1.0 and results[-1].info == {"outcome": "terminated", "return": 1.0}
        assert results[-1].observation.splitlines()[-1] == "HFF[G]"
        with pytest.raises(EnvError):
            await env.step("left")

    asyncio.run(go())


def test_taxi_text_invalid_replies_and_any_discrete_id() -> None:
    taxi = make_env("gymnasium", {"id": "Taxi-v3", "max_invalid": 2})

    async def go() -> None:
        board = await taxi.reset(1)
        assert "[ ]" in board and "(R)" in board  # the taxi and the coloured landmarks survive as text
        assert "0: south" in taxi.system_prompt and "5: dropoff" in taxi.system_prompt
        moved = await taxi.step("north")
        assert moved.reward == -1.0 and not moved.done
        assert not (await taxi.step("hmm")).done
        end = await taxi.step("no idea")
        assert end.done and end.info["outcome"] == "invalid"
        cart = make_env("gymnasium", {"id": "CartPole-v1"})  # no ANSI rendering, no action names: numbers work
        assert (await cart.reset(0)).startswith("observation: [")
        assert (await cart.step("1")).reward == 1.0

    asyncio.run(go())
    with pytest.raises(EnvError, match="Discrete"):
        make_env("gymnasium", {"id": "Pendulum-v1"})
    assert ansi_to_text("a\x1b[41mS\x1b[0mb\x1b[35mR\x1b[0m") == "a[S]b(R)"


def test_the_engine_plays_a_gymnasium_episode(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)
    env = make_env("gymnasium", {"id": "FrozenLake-v1", "max_turns": 4})

    async def go() -> None:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        try:
            record = await play_episode(env, None, ChatFormat(tokenizer), batcher, env_name="frozen_lake", seed=5,
                                        prompt_ordinal=0, group_id="g0", sampling=Sampling(), policy_version=lambda: 0,
                                        decode=tokenizer.decode)
        finally:
            await batcher.aclose()
        assert 1 <= record.turns <= 4 and record.info["outcome"] in ("terminated", "truncated", "too_many_turns", "invalid")
        assert "FrozenLake-v1" in tokenizer.decode(record.input_ids[:record.prompt_tokens].tolist())

    asyncio.run(go())


def test_rgb_array_frames_are_passed_through_as_images_when_asked() -> None:
    """`render_mode: rgb_array`: each observation is the environment's rendered frame (a real Gymnasium env
    registered here, since the toy-text ones draw their frames with pygame), checked and PNG-encoded."""
    import gymnasium
    import numpy as np

    from earl_stream.env import Observation, env_reset, env_step
    from earl_stream.env.images import decode_image

    class Lamp(gymnasium.Env):
        metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

        def __init__(self, render_mode: str | None = None) -> None:
            self.render_mode, self.on = render_mode, 0
            self.action_space = gymnasium.spaces.Discrete(2)
            self.observation_space = gymnasium.spaces.Discrete(2)

        def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[int, dict]:
            super().reset(seed=seed)
            self.on = 0
            return 0, {}

        def step(self, action: int) -> tuple[int, float, bool, bool, dict]:
            self.on = int(action)
            return self.on, float(action), bool(action), False, {}

        def render(self) -> np.ndarray:
            return np.full((6, 8, 3), 255 * self.on, dtype=np.uint8)

    gymnasium.register(id="EarlLamp-v0", entry_point=Lamp)
    env = make_env("gymnasium", {"id": "EarlLamp-v0", "render_mode": "rgb_array"})
    first = asyncio.run(env_reset(env, 0))
    assert isinstance(first, Observation) and first.text == "Your action?"
    assert np.asarray(decode_image(first.images[0])).max() == 0 and (first.images[0].width, first.images[0].height) == (8, 6)
    last = asyncio.run(env_step(env, "1"))
    assert last.done and isinstance(last.observation, Observation)
    assert np.asarray(decode_image(last.observation.images[0])).min() == 255
    with pytest.raises(EnvError, match=r"EarlLamp-v0 cannot render as ansi \(its render modes: \['rgb_array'\]\)"):
        make_env("gymnasium", {"id": "EarlLamp-v0", "render_mode": "ansi"})
    with pytest.raises(EnvError, match="render_mode must be ansi or rgb_array"):
        make_env("gymnasium", {"id": "EarlLamp-v0", "render_mode": "human"})
