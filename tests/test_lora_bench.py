"""bench/lora.py's summary on given repeats: each arm's gains per seed with a 95% interval computed by hand, the
gain ratio's interval (delta method), the interleaved run order, and the refusal of a comparison between one
configuration run twice."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from lora import config_digest, run_order, summarise  # noqa: E402
from stats import t975  # noqa: E402

AFTER = {"full": [0.21, 0.16, 0.235], "lora": [0.23, 0.235, 0.255], "trl_lora": [0.24]}
BEFORE = 0.14


def _result() -> dict:
    return {"heldout_before": {"success": BEFORE, "stderr": 0.025},
            **{kind: {"sync_bytes_per_version": 538_000_000 if kind == "full" else 1_220_000,
                      "sync_seconds_per_version": 1.35 if kind == "full" else 0.028,
                      "runs": [{"seed": s, "heldout_after": a, "heldout_after_stderr": 0.03,
                                "config_digest": config_digest(kind)} for s, a in enumerate(after)]}
               for kind, after in AFTER.items()}}


def test_gains_and_their_ratio_carry_intervals_computed_by_hand() -> None:
    result = _result()
    notes = summarise(result)
    full, lora = ([a - BEFORE for a in AFTER[k]] for k in ("full", "lora"))
    assert result["full"]["gains"] == pytest.approx(full)
    half = t975(2) * statistics.stdev(lora) / math.sqrt(3)
    assert result["lora"]["gain"] == pytest.approx({"mean": statistics.fmean(lora), "low": statistics.fmean(lora) - half,
                                                    "high": statistics.fmean(lora) + half, "n": 3})
    ratio = statistics.fmean(lora) / statistics.fmean(full)
    va, vb = statistics.variance(lora) / 3, statistics.variance(full) / 3
    rel = va / statistics.fmean(lora) ** 2 + vb / statistics.fmean(full) ** 2
    got = result["gain_ratio"]
    assert got["mean"] == pytest.approx(ratio) and got["n"] == 3
    assert (got["high"] - got["low"]) / 2 > abs(ratio) * math.sqrt(rel) * 1.96  # Student's t at Welch's df, not z
    assert got["low"] < ratio < got["high"]
    # one TRL seed: its value and binomial standard error, no interval
    assert result["trl_lora"]["gain"] == pytest.approx({"mean": 0.10, "stderr": math.hypot(0.025, 0.03), "n": 1})
    assert result["sync_bytes_ratio"] == pytest.approx(538_000_000 / 1_220_000)
    assert result["sync_seconds_ratio"] == pytest.approx(1.35 / 0.028)
    assert any("reaches zero" in n for n in notes) == (result["full"]["gain"]["low"] <= 0)


def test_one_configuration_in_both_arms_is_refused() -> None:
    result = _result()
    for run in result["lora"]["runs"]:
        run["config_digest"] = config_digest("full")
    with pytest.raises(ValueError, match="one configuration"):
        summarise(result)


def test_a_single_seed_per_arm_gives_no_ratio() -> None:
    result = _result()
    result["full"]["runs"] = result["full"]["runs"][:1]
    notes = summarise(result)
    assert result["gain_ratio"] is None and any("at least 2 seeds" in n for n in notes)


def test_the_arms_are_interleaved_seed_by_seed() -> None:
    order = run_order(3, 1, ["full", "lora", "trl_lora"])
    assert order == [("full", 0), ("lora", 0), ("trl_lora", 0), ("lora", 1), ("full", 1), ("full", 2), ("lora", 2)]
    assert run_order(2, 0, ["lora"]) == [("lora", 0), ("lora", 1)]
    assert config_digest("full") != config_digest("lora")
