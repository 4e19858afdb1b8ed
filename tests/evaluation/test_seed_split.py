"""The seed space split once (earl_stream/env/seeds.py): every seed training resets an environment with (the
ledger's prompt seeds, a group's per-episode seeds) lies in the training half, and an environment without a
held-out set (Tic-Tac-Toe) is evaluated on seeds of the other half; a game's evaluation reports its win, draw and
loss rates beside success."""

from __future__ import annotations

import random

import pytest

from earl_stream.config import EnvSpec
from earl_stream.env.seeds import EVAL_SEEDS, SEED_SPLIT, TRAIN_SEEDS, eval_seeds, train_seed
from earl_stream.evaluation.heldout import check_held_out, held_out_set
from earl_stream.evaluation.passk import EpisodeOutcome, summarize
from earl_stream.supervisor.ledger import Ledger
from earl_stream.workers.agent_loop import episode_env_seed


def test_the_halves_are_disjoint_and_cover_the_31_bit_seeds() -> None:
    assert TRAIN_SEEDS.stop == EVAL_SEEDS.start and len(TRAIN_SEEDS) + len(EVAL_SEEDS) == 1 << 31
    assert SEED_SPLIT == {"train": [0, 1 << 30], "eval": [1 << 30, 1 << 31]}
    assert train_seed((1 << 31) - 1) in TRAIN_SEEDS and train_seed(12345) == 12345
    assert eval_seeds(3) == [1 << 30, (1 << 30) + 1, (1 << 30) + 2]
    with pytest.raises(ValueError):
        eval_seeds(0)


@pytest.mark.parametrize("run_seed", [0, 1, 7, 2**20 + 3])
def test_training_never_resets_an_environment_with_an_evaluation_seed(run_seed: int) -> None:
    ledger = Ledger([EnvSpec()], seed=run_seed, group_size=8, groups_per_step=10_000, max_staleness=10_000)
    prompts = ledger.issue("w", 3000)
    assert len(prompts) == 3000
    seeds = [p.seed for p in prompts]
    assert all(s in TRAIN_SEEDS for s in seeds)
    rng = random.Random(run_seed)
    for prompt_seed in rng.sample(seeds, 200) + [rng.randrange(1 << 31) for _ in range(200)]:
        own = [episode_env_seed(prompt_seed, i, True) for i in range(8)]  # a group's per-episode seeds
        assert all(s in TRAIN_SEEDS for s in own) and len(set(own)) == 8


def test_a_game_without_held_out_items_is_played_on_evaluation_seeds() -> None:
    check_held_out("tictactoe")  # no held_out(): not refused
    held = held_out_set("tictactoe", {}, 16)
    assert held.items == "eval_seeds" and held.seeds == tuple(eval_seeds(16)) and held.params == {}
    assert all(s in EVAL_SEEDS for s in held.seeds) and held_out_set("tictactoe", {}, 16) == held
    assert "never issued for training" in held.describe()


def test_a_game_reports_win_draw_and_loss_rates_beside_success() -> None:
    outcomes = ["win", "win", "draw", "loss", "illegal"]
    s = summarize(EpisodeOutcome(i, 0, 0.0, o == "win", o) for i, o in enumerate(outcomes))
    assert s.success == pytest.approx(0.4)
    assert (s.win_rate, s.draw_rate, s.loss_rate) == pytest.approx((0.4, 0.2, 0.4))  # an illegal move loses
    assert s.to_dict()["loss_rate"] == pytest.approx(0.4)
    other = summarize(EpisodeOutcome(i, 0, 1.0, True, "correct") for i in range(3))
    assert (other.win_rate, other.draw_rate, other.loss_rate) == (None, None, None)
