"""bench/weight_swap.py's summary on given repeats: each mode's rollout tokens/s with its 95% interval and its ratio
over drain computed by hand (Student's t; delta method on the log ratio), `default_vs_drain` for the mode
`rollout.weight_swap=auto` runs, one-repeat check runs without intervals, and the refusal of a comparison between
identical configurations."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from weight_swap import summarise  # noqa: E402

RATES = {"drain": [600.0, 640.0, 620.0], "interrupt": [700.0, 690.0, 720.0], "inplace": [900.0, 860.0, 950.0]}


def _runs(rates: dict[str, list[float]]) -> dict[str, list[dict]]:
    return {m: [{"mode": m, "rollout_tokens_per_s": r, "swaps": 10} for r in rs] for m, rs in rates.items()}


def test_rates_and_ratios_carry_the_intervals_computed_by_hand() -> None:
    out = summarise(_runs(RATES), _runs(RATES), "inplace")
    got = out["pipeline"]["tokens_per_s"]["inplace"]
    v = RATES["inplace"]
    half = 4.303 * statistics.stdev(v) / math.sqrt(3)  # t(0.975, 2 degrees of freedom)
    assert got["mean"] == pytest.approx(statistics.fmean(v)) and got["n"] == 3
    assert (got["low"], got["high"]) == pytest.approx((statistics.fmean(v) - half, statistics.fmean(v) + half))
    ratio = out["default_vs_drain"]
    a, b = RATES["inplace"], RATES["drain"]
    va = statistics.variance(a) / (3 * statistics.fmean(a) ** 2)
    vb = statistics.variance(b) / (3 * statistics.fmean(b) ** 2)
    assert ratio["ratio"] == pytest.approx(statistics.fmean(a) / statistics.fmean(b))
    assert ratio["low"] < ratio["ratio"] < ratio["high"]
    assert math.log(ratio["high"] / ratio["ratio"]) == pytest.approx(math.log(ratio["ratio"] / ratio["low"]))
    assert math.log(ratio["high"] / ratio["ratio"]) >= 1.96 * math.sqrt(va + vb)  # t's quantile is above the normal's
    assert ratio == out["pipeline"]["speedup_vs_drain"]["inplace"] and out["engine"] == out["pipeline"]
    assert out["modes"]["drain"][0]["rollout_tokens_per_s"] == 600.0  # every repeat kept beside the means


def test_the_default_being_drain_is_no_speedup_and_identical_arms_are_refused() -> None:
    assert summarise(_runs(RATES), {}, "drain")["default_vs_drain"] is None
    runs = _runs(RATES)
    runs["inplace"][1]["mode"] = "drain"  # one "inplace" repeat ran drain's configuration
    with pytest.raises(ValueError, match="not a comparison"):
        summarise(runs, {}, "inplace")


def test_one_repeat_gives_means_without_intervals() -> None:
    one = {m: v[:1] for m, v in RATES.items()}
    out = summarise(_runs(one), {}, "inplace")
    assert out["pipeline"]["tokens_per_s"]["drain"] == {"mean": 600.0, "n": 1}
    assert out["default_vs_drain"] == {"ratio": pytest.approx(1.5)}
