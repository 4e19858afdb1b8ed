"""What the episodes of a GRPO group reset their environment with (`EnvSpec.group_seed`).

Tic-Tac-Toe's seed only draws the random opponent's moves. With one seed per group, a deterministic player
plays its group's 8 games alike: a mistake it always makes loses all 8, and the group's equal rewards carry
no advantage to correct it. With a seed per episode the same player meets different opponents.
"""

from __future__ import annotations

import asyncio

import pytest
from earl_stream_envs.calculator import Calculator
from earl_stream_envs.tictactoe import TicTacToe

from earl_stream.config import EnvSpec, load_config
from earl_stream.env import env_reset, env_step, seeds_per_episode
from earl_stream.errors import ConfigError, EnvError
from earl_stream.workers.agent_loop import episode_env_seed, episode_sample_seed


def test_auto_asks_the_environment_and_the_config_overrides_it() -> None:
    assert seeds_per_episode("auto", TicTacToe())  # its seed draws chance only
    assert not seeds_per_episode("auto", Calculator())  # its seed picks the question: the group shares it
    assert not seeds_per_episode("shared", TicTacToe())
    assert seeds_per_episode("per_episode", Calculator())

    class Vague:
        seed_per_episode = "yes"

    with pytest.raises(EnvError, match="seed_per_episode must be a bool"):
        seeds_per_episode("auto", Vague())


def test_episode_seeds() -> None:
    prompt_seed = 123_457
    assert [episode_env_seed(prompt_seed, i, False) for i in range(8)] == [prompt_seed] * 8
    own = [episode_env_seed(prompt_seed, i, True) for i in range(8)]
    assert len(set(own)) == 8 and prompt_seed not in own
    assert own == [episode_env_seed(prompt_seed, i, True) for i in range(8)]  # a pure function: replays
    assert not set(own) & {episode_sample_seed(prompt_seed, i) for i in range(8)}


async def _lowest_cell_game(seed: int) -> tuple[str, str]:
    """A deterministic player (always the lowest empty cell) against the opponent of `seed`: (outcome, board)."""
    env = TicTacToe()
    await env_reset(env, seed)
    while True:
        step = await env_step(env, str(env.legal_moves()[0]))
        if step.done:
            return step.info["outcome"], step.observation


def test_a_deterministic_player_meets_different_opponents_only_with_a_seed_each() -> None:
    async def group(prompt_seed: int, per_episode: bool) -> list[tuple[str, str]]:
        return [await _lowest_cell_game(episode_env_seed(prompt_seed, i, per_episode)) for i in range(8)]

    shared = [asyncio.run(group(p, False)) for p in range(20)]
    own = [asyncio.run(group(p, True)) for p in range(20)]
    assert all(len(set(games)) == 1 for games in shared)  # 8 copies of one game: equal rewards, no advantage
    assert all(len({board for _, board in games}) > 1 for games in own)
    # wins and non-wins within one group: an advantage for the mistake (the lowest cell loses some games)
    assert any(len({outcome for outcome, _ in games}) > 1 for games in own)
    # and with one seed a group the player's mistake loses all 8 games of some groups: no advantage at all
    assert any(games[0][0] != "win" for games in shared)


def test_group_seed_is_checked_at_config_load(tmp_path) -> None:
    assert load_config(None, []).envs[0].group_seed == EnvSpec().group_seed == "auto"
    with pytest.raises(ConfigError, match="group_seed"):
        load_config(None, ["envs.0.group_seed=sometimes"])
