"""ConnectFour: observation format, gravity, legality, win detection in every direction, rewards, seeds."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from earl_stream_envs.connect_four import COLUMNS, ROWS, ConnectFour

from earl_stream.env import StepResult, env_options
from earl_stream.errors import EnvError

T = TypeVar("T")

HEADER = "1 2 3 4 5 6 7"
EMPTY = "\n".join([HEADER] + [". . . . . . ."] * 6)
DRAW_SEED = 38  # with X drawn from random.Random(-seed - 1), this game fills the board with no four


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def grid(observation: str) -> list[list[str]]:
    """Rows bottom-up (row 0 = bottom), each a list of 7 cells."""
    lines = observation.split("\n")
    assert lines[0] == HEADER and len(lines) == ROWS + 1
    rows = [line.split(" ") for line in lines[1:]]
    assert all(len(r) == COLUMNS and set(r) <= {".", "X", "O"} for r in rows)
    return rows[::-1]


_LINES = [
    [(r + i * dr, c + i * dc) for i in range(4)]
    for r in range(ROWS) for c in range(COLUMNS) for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1))
    if 0 <= r + 3 * dr < ROWS and 0 <= c + 3 * dc < COLUMNS
]


def fours(g: list[list[str]], mark: str) -> bool:
    """Reference check over all 69 lines, independent of the environment's incremental one."""
    return any(all(g[r][c] == mark for r, c in line) for line in _LINES)


def random_game(seed: int) -> tuple[list[StepResult], list[str]]:
    async def go() -> tuple[list[StepResult], list[str]]:
        env = ConnectFour()
        observations = [await env.reset(seed)]
        rng = random.Random(-seed - 1)
        results: list[StepResult] = []
        while not results or not results[-1].done:
            legal = env.legal_moves()
            board = grid(observations[-1])
            assert legal == [c + 1 for c in range(COLUMNS) if board[ROWS - 1][c] == "."]
            results.append(await env.step(str(rng.choice(legal))))
            observations.append(results[-1].observation)
        assert env.legal_moves() == []
        return results, observations

    return run(go())


def test_first_observation_and_attributes() -> None:
    env = ConnectFour()
    assert run(env.reset(0)) == EMPTY
    assert env.legal_moves() == list(range(1, 8))
    opts = env_options(env)
    assert opts.max_turn_tokens == 4 and opts.max_episode_tokens is None
    assert opts.system_prompt is not None and "1-7" in opts.system_prompt


def test_discs_fall_to_the_bottom_then_o_replies() -> None:
    env = ConnectFour()
    run(env.reset(5))
    result = run(env.step(" 4\n"))
    assert not result.done and result.reward == 0.0 and result.info == {}
    g = grid(result.observation)
    assert g[0][3] == "X"
    flat = [cell for row in g for cell in row]
    assert flat.count("X") == 1 and flat.count("O") == 1
    (o_row, o_col), = [(r, c) for r in range(ROWS) for c in range(COLUMNS) if g[r][c] == "O"]
    assert o_row == (1 if o_col == 3 else 0)

@pytest.mark.parametrize("bad", ["0", "8", "", "x", "3 3", "+3", "٣", "3.", "col 3", "33", "-1"])
def test_unparseable_replies_end_the_game_as_illegal(bad: str) -> None:
    env = ConnectFour()
    run(env.reset(0))
    assert run(env.step(bad)) == StepResult(EMPTY, -1.0, True, {"outcome": "illegal"})


def test_a_full_column_is_illegal() -> None:
    # X plays column 1 unless that would stack a fourth X; search for a seed where column 1 fills up.
    for seed in range(300):
        env = ConnectFour()
        obs = run(env.reset(seed))
        rng = random.Random(seed)
        result = None
        while 1 in env.legal_moves():
            column = [row[0] for row in grid(obs)]
            top = column[: column.index(".")] if "." in column else column
            move = 1 if top[-3:] != ["X", "X", "X"] else rng.choice([m for m in env.legal_moves() if m != 1])
            result = run(env.step(str(move)))
            obs = result.observation
            if result.done:
                break
        if result is not None and not result.done:
            assert [row[0] for row in grid(obs)].count(".") == 0
            final = run(env.step("1"))
            assert final == StepResult(obs, -1.0, True, {"outcome": "illegal"})
            return
    pytest.fail("no seed filled column 1 without ending the game")


def test_random_games_follow_the_rules_and_replay_by_seed() -> None:
    outcomes: dict[str, int] = {}
    games = 200
    for seed in range(games):
        results, observations = random_game(seed)
        for before, after in itertools.pairwise(observations):
            b, a = grid(before), grid(after)
            changed = [(r, c) for r in range(ROWS) for c in range(COLUMNS) if b[r][c] != a[r][c]]
            assert all(b[r][c] == "." for r, c in changed) and 1 <= len(changed) <= 2
            # gravity: no disc floats above an empty cell
            assert all(not (a[r][c] != "." and a[r - 1][c] == ".") for r in range(1, ROWS) for c in range(COLUMNS))
        for result in results[:-1]:
            assert result.reward == 0.0 and result.info == {}
            assert not fours(grid(result.observation), "X") and not fours(grid(result.observation), "O")
        last = results[-1]
        final = grid(last.observation)
        outcome = last.info["outcome"]
        assert last.reward == {"win": 1.0, "draw": 0.0, "loss": -1.0}[outcome]
        assert fours(final, "X") == (outcome == "win")
        assert fours(final, "O") == (outcome == "loss")
        if outcome == "draw":
            assert all(cell != "." for row in final for cell in row)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if seed % 50 == 0:
            assert random_game(seed) == (results, observations)
    assert {"win", "loss"} <= set(outcomes)
    # Random X vs random O: the first player wins ~56% (measured over 20k games).
    assert 0.42 < outcomes["win"] / games < 0.70


def test_a_draw_fills_the_board_and_scores_zero() -> None:
    results, observations = random_game(DRAW_SEED)
    assert results[-1].info == {"outcome": "draw"} and results[-1].reward == 0.0
    final = grid(observations[-1])
    assert all(cell != "." for row in final for cell in row)
    assert not fours(final, "X") and not fours(final, "O")
    assert sum(r.reward for r in results) == 0.0


def test_vertical_win() -> None:
    for seed in range(200):
        env = ConnectFour()
        run(env.reset(seed))
        results = [run(env.step("4")) for _ in range(3)]
        if any(r.done for r in results) or any(grid(r.observation)[i][3] != "X" for i, r in enumerate(results)):
            continue
        final = run(env.step("4"))
        assert final.done and final.reward == 1.0 and final.info == {"outcome": "win"}
        return
    pytest.fail("no seed let X stack four in column 4")


def test_step_after_end_raises() -> None:
    env = ConnectFour()
    run(env.reset(0))
    run(env.step("9"))
    with pytest.raises(EnvError, match="reset"):
        run(env.step("1"))
