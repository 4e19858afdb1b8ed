"""bench/moe.py's summaries (`bench/moe_replay.py`) on recorded repeats: the equal-weights comparison of routing
replay (3 seeds recorded from a bf16 run of the 4-layer, 8-expert tiny MoE) and the learning runs' final reward
and collapses."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from moe_replay import learning_summary, summarise_equal  # noqa: E402

# (replay, no_replay) per seed: kl_k3, routing_mismatch, mean_abs_logprob_diff
RECORDED = [((5.116e-05, 0.01022, 0.007661), (0.002657, 0.01935, 0.02624)),
            ((4.344e-05, 0.01018, 0.00706), (0.00449, 0.02656, 0.03491)),
            ((4.448e-05, 0.009662, 0.007142), (0.002932, 0.02194, 0.02892))]
METRICS = ("kl_k3", "routing_mismatch", "mean_abs_logprob_diff")


def _repeats(rows: list) -> list[dict]:
    return [{"seed": i, "replay": dict(zip(METRICS, r)), "no_replay": dict(zip(METRICS, n))}
            for i, (r, n) in enumerate(rows)]


def _interval(values: list[float]) -> tuple[float, float]:
    """The 95% interval of 3 values by hand: Student's t at 2 degrees of freedom."""
    half = 4.303 * statistics.stdev(values) / math.sqrt(len(values))
    return statistics.fmean(values) - half, statistics.fmean(values) + half


def test_the_equal_weights_summary_gives_each_arms_interval_and_the_kl_ratio() -> None:
    out = summarise_equal(_repeats(RECORDED))
    for j, metric in enumerate(METRICS):
        for a, arm in enumerate(("replay", "no_replay")):
            values = [row[a][j] for row in RECORDED]
            got = out[metric][arm]
            assert got["n"] == 3 and got["mean"] == pytest.approx(statistics.fmean(values))
            assert (got["low"], got["high"]) == pytest.approx(_interval(values))
    ratio = out["kl_ratio_replay_over_no_replay"]
    means = [statistics.fmean(row[a][0] for row in RECORDED) for a in (0, 1)]
    assert ratio["ratio"] == pytest.approx(means[0] / means[1])
    assert ratio["low"] < ratio["ratio"] < ratio["high"] < 0.05  # replay: under a twentieth of the KL without it
    assert out["goal_met"]


def test_identical_arms_show_no_reduction() -> None:
    same = [(n, n) for _, n in RECORDED]
    out = summarise_equal(_repeats(same))
    ratio = out["kl_ratio_replay_over_no_replay"]
    assert ratio["ratio"] == pytest.approx(1.0) and ratio["low"] < 1.0 < ratio["high"]
    assert not out["goal_met"]
    # a gain within the noise is refused too: replay 20% lower on one seed only
    noisy = [((n[0] * (0.8 if i == 0 else 1.0), *n[1:]), n) for i, (_, n) in enumerate(RECORDED)]
    assert not summarise_equal(_repeats(noisy))["goal_met"]


def _curve(*rewards: float) -> list[dict]:
    return [{"t": 5.0 * i, "step": i, "reward": r} for i, r in enumerate(rewards)]


def test_learning_summary_takes_the_last_points_and_counts_collapses() -> None:
    steady = {"seed": 0, "curve": _curve(-0.8, -0.2, 0.2, 0.3, 0.1, 0.2), "exit_code": None}
    dropped = {"seed": 1, "curve": _curve(-0.8, 0.4, 0.3, -0.3, -0.4, -0.5), "exit_code": None}
    died = {"seed": 2, "curve": _curve(-0.8, -0.6, -0.5), "exit_code": 1}
    empty = {"seed": 3, "curve": [], "exit_code": None}
    out = learning_summary({"replay": [steady, steady], "no_replay": [steady, dropped, died, empty]})
    assert out["replay"]["collapses"] == 0 and out["replay"]["runs"] == 2
    assert out["replay"]["final_reward_repeats"] == pytest.approx([0.2, 0.2])
    assert out["no_replay"]["collapses"] == 3 and out["no_replay"]["runs"] == 4
    assert out["no_replay"]["final_reward_repeats"] == pytest.approx([0.2, -0.4, -0.6333333])
    assert out["no_replay"]["final_reward"]["n"] == 3
    assert learning_summary({"replay": [steady]})["replay"]["final_reward"] is None  # one run: no interval


def test_the_benchmarks_page_shows_each_arm_with_its_interval_and_the_ratio() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.report_tables import render_moe

    summary = summarise_equal(_repeats(RECORDED))
    d = {"routing_mismatch_equal_weights": summary["routing_mismatch"], "logprob_kl_equal_weights": summary["kl_k3"],
         "logprob_abs_diff_equal_weights": summary["mean_abs_logprob_diff"],
         "kl_ratio_replay_over_no_replay": summary["kl_ratio_replay_over_no_replay"], "goal_met": summary["goal_met"],
         "learning": {"replay": {"final_reward": None, "collapses": 0, "runs": 1}}}
    page = "\n".join(render_moe(d))
    kl = summary["kl_k3"]["no_replay"]
    assert f"{kl['mean']:.3g} [{kl['low']:.3g}, {kl['high']:.3g}], n=3" in page
    assert "(goal <= 0.5: true)" in page and "| 0 of 1 |" in page
