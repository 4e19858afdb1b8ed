"""The statistics window: outcome rates, their standard error clustered by group, and window_stats, by hand."""

from __future__ import annotations

import math

import pytest

from earl_stream.supervisor.episode_window import Finished, outcome_rate, outcome_rate_stderr, window_stats


def _window(*groups: tuple[str, list[str]]) -> list[Finished]:
    return [Finished(0.0, outcome, 10, "tictactoe", group) for group, outcomes in groups for outcome in outcomes]


def test_one_game_per_group_is_the_binomial_error() -> None:
    window = _window(("g1", ["win"]), ("g2", ["win"]), ("g3", ["loss"]), ("g4", ["draw"]))
    assert outcome_rate(window, "win") == 0.5
    # p = 0.5, sum_g (k_g - p)^2 = 4 * 0.25 = 1, se = sqrt(4/3 * 1) / 4 = sqrt(0.25 / 3)
    assert outcome_rate_stderr(window, "win") == pytest.approx(math.sqrt(0.25 / 3))


def test_identical_games_of_a_group_widen_the_error() -> None:
    # two groups of two identical games: really two draws, not four
    window = _window(("g1", ["win", "win"]), ("g2", ["loss", "loss"]))
    assert outcome_rate(window, "win") == 0.5
    # p = 0.5, (2 - 1)^2 + (0 - 1)^2 = 2, se = sqrt(2/1 * 2) / 4 = 0.5 (binomial over 4 games: 0.25)
    assert outcome_rate_stderr(window, "win") == pytest.approx(0.5)
    assert outcome_rate_stderr(window, "draw") == 0.0


def test_an_empty_window_or_a_single_group_has_no_error() -> None:
    assert outcome_rate([], "win") is None and outcome_rate_stderr([], "win") is None
    assert outcome_rate_stderr(_window(("g1", ["win", "loss", "win"])), "win") is None


def test_window_stats_by_hand() -> None:
    window = [Finished(1.0, "win", 10, "ttt", "g1"), Finished(-1.0, "loss", 20, "ttt", "g1"),
              Finished(1.0, "win", 30, "ttt", "g2"), Finished(0.5, "correct", 40, "calc", "g3")]
    s = window_stats(window)
    assert s.mean_reward == pytest.approx(1.5 / 4)
    assert s.outcomes == {"correct": 0.25, "loss": 0.25, "win": 0.5}
    # numpy's linear percentiles of 10, 20, 30, 40: p50 = 25, p90 = 37, p99 = 39.7
    assert s.context_length == pytest.approx({"p50": 25.0, "p90": 37.0, "p99": 39.7, "max": 40.0})
    ttt, calc = s.envs["ttt"], s.envs["calc"]
    assert (ttt.episodes, ttt.mean_reward, ttt.mean_context_tokens) == (3, pytest.approx(1 / 3), 20.0)
    assert ttt.outcomes == {"loss": 0.3333, "win": 0.6667} and calc.outcomes == {"correct": 1.0}
    assert window_stats([]) == (None, {}, {}, {})
