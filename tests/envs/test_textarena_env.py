"""TextArenaEnv against the real textarena package: two-player games vs scripted opponents, seeds,
rewards, invalid moves, and isolation of TextArena's use of the global `random` module."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

pytest.importorskip("textarena")

from earl_stream_envs.textarena_env import TextArenaEnv, listed_moves

from earl_stream.env import StepResult, env_options, make_env
from earl_stream.errors import EnvError

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def play(env: TextArenaEnv, seed: int, policy_seed: int) -> tuple[list[str], StepResult]:
    """Random legal play for the model (from the moves the game lists); returns observations and the end."""
    async def go() -> tuple[list[str], StepResult]:
        observations = [await env.reset(seed)]
        rng = random.Random(policy_seed)
        while True:
            moves = listed_moves(observations[-1])
            result = await env.step(rng.choice(moves) if moves else "[0]")
            observations.append(result.observation)
            if result.done:
                return observations, result
            assert result.reward == 0.0 and result.info == {}

    return run(go())


def test_tictactoe_first_observation_and_a_move() -> None:
    env = TextArenaEnv("TicTacToe-v0")
    opts = env_options(env)
    assert opts.system_prompt is None and opts.max_turn_tokens == 32
    first = run(env.reset(0))
    assert first.startswith("[GAME] You are Player 0 in Tic Tac Toe.")
    assert listed_moves(first) == [f"[{i}]" for i in range(9)]
    result = run(env.step("4"))  # brackets are added, as TextArena's ActionFormattingWrapper does
    assert not result.done
    assert "[GAME] Player 0 placed their symbol (O) in cell 4." in result.observation
    assert "[Player 1] [" in result.observation and "[Player 0]" not in result.observation
    moves = listed_moves(result.observation)
    assert len(moves) == 7 and "[4]" not in moves


def test_random_games_end_with_textarena_rewards_and_replay_by_seed() -> None:
    env = TextArenaEnv("TicTacToe-v0")
    outcomes: dict[str, int] = {}
    for seed in range(60):
        observations, last = play(env, seed, policy_seed=seed + 1000)
        assert last.reward == {"win": 1.0, "loss": -1.0, "draw": 0.0}[last.info["outcome"]]
        assert last.info["game"] == "TicTacToe-v0"
        outcomes[last.info["outcome"]] = outcomes.get(last.info["outcome"], 0) + 1
        if seed % 20 == 0:
            assert play(TextArenaEnv("TicTacToe-v0"), seed, policy_seed=seed + 1000) == (observations, last)
    assert {"win", "loss"} <= set(outcomes)


def test_invalid_moves_get_one_retry_then_lose() -> None:
    env = TextArenaEnv("TicTacToe-v0")
    run(env.reset(1))
    retry = run(env.step("[42]"))
    assert not retry.done and "attempted an invalid move" in retry.observation
    lost = run(env.step("nonsense"))
    assert lost.done and lost.reward == -1.0 and lost.info["outcome"] == "illegal"
    with pytest.raises(EnvError, match="reset"):
        run(env.step("[0]"))


def test_model_as_second_player_and_connect_four_opponent_table() -> None:
    env = TextArenaEnv("ConnectFour-v0", model_player=1)
    first = run(env.reset(5))
    assert "[Player 0] [col " in first and "Player 0 dropped their disk (X)" in first
    result = run(env.step("[col 3]"))
    assert not result.done and "Player 1 dropped their disk (O) into column 3." in result.observation
    drawn = set()
    for seed in range(20):
        e = TextArenaEnv("TicTacToe-v0", model_player="random")
        run(e.reset(seed))
        drawn.add(e._me)
    assert drawn == {0, 1}


@pytest.mark.parametrize("game", ["ConnectFour-v0", "Nim-v0", "KuhnPoker-v0", "SimpleTak-v0", "WildTicTacToe-v0",
                                  "IteratedRockPaperScissors-v0"])
def test_other_two_player_games_run_to_the_end(game: str) -> None:
    env = TextArenaEnv(game)
    for seed in range(3):
        _, last = play(env, seed, policy_seed=seed + 7)
        assert last.info["outcome"] in {"win", "loss", "draw", "illegal"}
        assert last.reward in (-1.0, 0.0, 1.0)


def test_scripted_opponents_and_truncation() -> None:
    first = TextArenaEnv("TicTacToe-v0", opponent="first")
    obs = run(first.reset(0))
    after = run(first.step("[4]"))
    assert "[Player 1] [0]" in after.observation and obs
    calls: list[str] = []

    def corner(observation: str, rng: random.Random) -> str:
        calls.append(observation)
        return "[8]"

    scripted = TextArenaEnv("TicTacToe-v0", opponent=corner, max_turns=1)
    run(scripted.reset(0))
    truncated = run(scripted.step("[0]"))
    assert calls and "Player 0 placed their symbol (O) in cell 0." in calls[0]
    assert truncated == StepResult(truncated.observation, 0.0, True, {"outcome": "truncated", "game": "TicTacToe-v0"})
    via_spec = TextArenaEnv("TicTacToe-v0", opponent="earl_stream_envs.textarena_env:first_opponent")
    assert via_spec.opponent_name == "earl_stream_envs.textarena_env:first_opponent"


def test_global_random_is_untouched_and_episodes_are_isolated() -> None:
    async def interleaved() -> list[list[str]]:
        envs = [TextArenaEnv("KuhnPoker-v0"), TextArenaEnv("KuhnPoker-v0")]
        obs = [[await envs[0].reset(3)], [await envs[1].reset(4)]]
        done = [False, False]
        while not all(done):
            for i, env in enumerate(envs):
                if not done[i]:
                    moves = listed_moves(obs[i][-1])
                    result = await env.step(moves[0] if moves else "[check]")
                    obs[i].append(result.observation)
                    done[i] = result.done
        return obs

    random.seed(123)
    expected_next = random.random()
    random.seed(123)
    together = run(interleaved())
    assert random.random() == expected_next  # TextArena's random.seed() did not leak out
    alone = [play_first_moves("KuhnPoker-v0", 3), play_first_moves("KuhnPoker-v0", 4)]
    assert together == alone


def play_first_moves(game: str, seed: int) -> list[str]:
    async def go() -> list[str]:
        env = TextArenaEnv(game)
        obs = [await env.reset(seed)]
        while True:
            moves = listed_moves(obs[-1])
            result = await env.step(moves[0] if moves else "[check]")
            obs.append(result.observation)
            if result.done:
                return obs

    return run(go())


def test_construction_errors_and_registry_params() -> None:
    with pytest.raises(EnvError, match="unknown TextArena game"):
        TextArenaEnv("NoSuchGame-v0")
    with pytest.raises(EnvError, match="model_player"):
        TextArenaEnv("TicTacToe-v0", model_player=2)
    with pytest.raises(EnvError, match="opponent"):
        TextArenaEnv("TicTacToe-v0", opponent="nonsense")
    with pytest.raises(EnvError, match="cannot run here.*bogus"):
        TextArenaEnv("TicTacToe-v0", env_kwargs={"bogus": 1})
    env = make_env("textarena", {"game": "TicTacToe-v0", "model_player": "1", "max_turns": "5"})
    assert isinstance(env, TextArenaEnv) and env.model_player == 1 and env.max_turns == 5
