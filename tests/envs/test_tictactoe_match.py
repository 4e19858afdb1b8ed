"""The Tic-Tac-Toe match environment: games follow one another in one episode, the match is scored once
at its end (fraction of games won), the curriculum adds games per new seed, and a context limit is an
episode option; it resolves by its registered name."""

from __future__ import annotations

import asyncio

import pytest
from earl_stream_envs.tictactoe import TicTacToe
from earl_stream_envs.tictactoe_match import TicTacToeMatch

from earl_stream.env import env_options, env_reset, env_step, make_env
from earl_stream.errors import EnvError


async def _play(env: TicTacToeMatch, seed: int, pick=min) -> tuple[list[str], object]:
    """Play `pick(legal moves)` until the match ends; the observations and the final step."""
    boards = [await env_reset(env, seed)]
    while True:
        result = await env_step(env, str(pick(env.legal_moves())))
        if result.done:
            return boards, result
        boards.append(result.observation)
        assert result.reward == 0.0  # paid once, at the end


async def _games(seed_base: int, games: int, pick=min) -> list[str]:
    """The outcomes of playing each game of a match alone, as plain TicTacToe with the match's opponent seeds."""
    out = []
    for i in range(games):
        game = TicTacToe()
        await game.reset(seed_base * 100 + i)
        while True:
            r = await game.step(str(pick(game.legal_moves())))
            if r.done:
                out.append(r.info["outcome"])
                break
    return out


def test_a_match_plays_its_games_in_turn_and_pays_the_fraction_won_at_the_end() -> None:
    async def go() -> None:
        env = TicTacToeMatch(games=3)
        boards, final = await _play(env, 7)
        assert boards[0] == "1 2 3\n4 5 6\n7 8 9"
        assert sum(b == "1 2 3\n4 5 6\n7 8 9" for b in boards) == 3  # each game starts on an empty board
        outcomes = await _games(7, 3)
        assert final.done and final.info["games"] == 3 and final.info["level"] == 0
        assert final.info["wins"] == outcomes.count("win") and final.info["losses"] == outcomes.count("loss")
        assert final.reward == pytest.approx(outcomes.count("win") / 3)
        with pytest.raises(EnvError, match="finished match"):
            await env_step(env, "1")

    asyncio.run(go())


def test_an_illegal_reply_loses_that_game_and_the_match_goes_on() -> None:
    async def go() -> None:
        env = TicTacToeMatch(games=2)
        await env_reset(env, 1)
        nxt = await env_step(env, "banana")
        assert not nxt.done and nxt.observation == "1 2 3\n4 5 6\n7 8 9"  # game 2 starts
        _, final = await _play_from(env)
        assert final.info["illegal"] == 1 and final.info["games"] == 2

    async def _play_from(env):
        while True:
            r = await env_step(env, str(min(env.legal_moves())))
            if r.done:
                return None, r

    asyncio.run(go())


def test_the_curriculum_adds_a_game_per_grow_every_new_seeds_and_a_group_shares_its_match() -> None:
    async def go() -> None:
        params = {"games": 1, "max_games": 3, "grow_every": 2}
        games = []
        for seed in range(5000, 5008):
            members = [TicTacToeMatch(**params) for _ in range(3)]  # a GRPO group: same seed, same match
            finals = [(await _play(m, seed))[1] for m in members]
            assert len({(f.info["games"], f.reward) for f in finals}) == 1
            games.append(finals[0].info["games"])
        assert games == [1, 1, 2, 2, 3, 3, 3, 3]

    asyncio.run(go())


def test_registered_options_and_bad_parameters() -> None:
    env = make_env("tictactoe_match", {"games": "2", "max_episode_tokens": "300"})  # --param passes strings
    opts = env_options(env)
    assert opts.max_episode_tokens == 300 and opts.max_turn_tokens == TicTacToe.max_turn_tokens
    assert opts.system_prompt == TicTacToe.system_prompt
    assert env_options(TicTacToeMatch()).max_episode_tokens is None
    for bad in ({"games": 0}, {"games": 9, "max_games": 8}, {"max_games": 101}, {"grow_every": -1}):
        with pytest.raises(EnvError, match="TicTacToeMatch needs"):
            TicTacToeMatch(**bad)
    with pytest.raises(EnvError, match="max_episode_tokens must be >= 1"):
        TicTacToeMatch(max_episode_tokens=0)
