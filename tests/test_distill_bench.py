"""bench/distill.py's summary on given repeats: steps to the target per arm and seed, the paired ratio of steps
against GRPO with its 95% interval computed by hand, runs that never reach the target, and the refusal of a
comparison between identical configurations."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from distill import arm_overrides, run_figures, summarise  # noqa: E402

TEACHER = "/models/teacher"
# steps to a 0.9 win rate per seed (None: not within the budget)
STEPS = {"grpo": [200, 160, 240], "distill_reward": [90, 100, None], "distill_loss": [150, 120, 200]}
FINAL = {"grpo": [0.91, 0.92, 0.90], "distill_reward": [0.94, 0.93, 0.85], "distill_loss": [0.92, 0.93, 0.9]}


def _runs() -> list[dict]:
    return [{"arm": arm, "seed": s, "overrides": [f"seed={s}", *arm_overrides(arm, TEACHER, 0.1)],
             "steps_to_target": STEPS[arm][s], "seconds_to_target": None if STEPS[arm][s] is None else STEPS[arm][s] * 1.5,
             "final_win_rate": FINAL[arm][s]} for s in range(3) for arm in STEPS]


def _interval(values: list[float]) -> tuple[float, float]:
    half = {1: 12.706, 2: 4.303}[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return statistics.fmean(values) - half, statistics.fmean(values) + half


def test_the_summary_pairs_seeds_and_gives_the_ratio_of_steps_with_its_interval() -> None:
    out = summarise(_runs())
    assert out["steps_to_target"] == STEPS and out["final_win_rate"] == FINAL and out["seeds"] == [0, 1, 2]
    loss = [150 / 200, 120 / 160, 200 / 240]
    got = out["distill_vs_grpo_steps"]["distill_loss"]
    assert got["per_seed"] == pytest.approx(loss) and got["n"] == 3
    low, high = _interval(loss)
    assert (got["mean"], got["low"], got["high"]) == pytest.approx((statistics.fmean(loss), low, high))
    # the reward arm never reached the target on seed 2: only the two paired seeds count
    reward = [90 / 200, 100 / 160]
    got = out["distill_vs_grpo_steps"]["distill_reward"]
    assert got["per_seed"] == pytest.approx(reward) and got["n"] == 2
    assert (got["low"], got["high"]) == pytest.approx(_interval(reward))
    best = out["best_distill_vs_grpo_steps"]
    assert best["arm"] == "distill_reward" and best["mean"] == pytest.approx(statistics.fmean(reward))
    assert out["final_win_rate_mean"]["grpo"] == pytest.approx(0.91)


def test_a_distillation_arm_that_ran_grpos_configuration_is_refused() -> None:
    runs = _runs()
    for r in runs:
        if r["arm"] == "distill_loss":
            r["overrides"] = [f"seed={r['seed']}"]  # e.g. coef 0 left out: the same run as grpo
    with pytest.raises(ValueError, match="same configuration"):
        summarise(runs)


def test_one_run_reaches_the_target_at_its_first_full_window_at_or_above_it() -> None:
    curve = [{"t": 5.0, "step": 3, "win": 0.95, "full": False}, {"t": 10.0, "step": 7, "win": 0.88, "full": True},
             {"t": 15.0, "step": 11, "win": 0.9, "full": True}, {"t": 20.0, "step": 15, "win": 0.87, "full": True}]
    assert run_figures(curve, 0.9) == {"steps_to_target": 11, "seconds_to_target": 15.0, "final_win_rate": 0.87,
                                       "steps": 15, "seconds": 20.0}
    assert run_figures(curve[:2], 0.9)["steps_to_target"] is None


def test_the_arms_differ_only_by_the_distillation_settings() -> None:
    assert arm_overrides("grpo", TEACHER, 0.1) == []
    assert arm_overrides("distill_reward", TEACHER, 0.1) == [f"algo.distill.teacher={TEACHER}", "algo.distill.coef=0.1",
                                                             "algo.distill.mode=reward"]
    assert arm_overrides("distill_loss", TEACHER, 0.1)[-1] == "algo.distill.mode=loss"
