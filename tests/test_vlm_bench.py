"""bench/vlm.py's summary of the KV-reuse part on given repeats: turns/s per arm with its 95% interval, the reuse
speedup as a ratio of means with its interval, a one-repeat check run without intervals, runs of unknown arms
refused; and its parsing of the trainer's pull lines."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from stats import mean_ci95, ratio_ci95  # noqa: E402
from vlm import PULL_LINE, summarise_kv  # noqa: E402

TURNS = {"reuse": [11.0, 12.5, 11.8], "no_reuse": [9.1, 9.6, 8.8]}


def _runs(turns: dict[str, list[float]]) -> list[dict]:
    return [{"arm": arm, "seed": s, "turns_per_s": v} for s in range(3) for arm, vs in turns.items()
            for v in vs[s:s + 1]]


def test_the_reuse_speedup_is_a_ratio_of_means_with_its_interval() -> None:
    out = summarise_kv(_runs(TURNS))
    assert out["turns_per_s"]["reuse"] == mean_ci95(TURNS["reuse"])
    assert out["kv_reuse_speedup"] == ratio_ci95(TURNS["reuse"], TURNS["no_reuse"])
    assert out["kv_reuse_speedup"]["ratio"] == pytest.approx(statistics.fmean(TURNS["reuse"])
                                                             / statistics.fmean(TURNS["no_reuse"]))
    assert [r["turns_per_s"] for r in out["runs"]["no_reuse"]] == TURNS["no_reuse"]  # every repeat kept


def test_one_repeat_has_no_interval_and_unknown_arms_are_refused() -> None:
    out = summarise_kv(_runs({"reuse": [12.0], "no_reuse": [8.0]}))
    assert out["kv_reuse_speedup"] == {"ratio": 1.5} and "turns_per_s" not in out
    with pytest.raises(ValueError, match="unknown arms"):
        summarise_kv([*_runs(TURNS), {"arm": "reuse_again", "seed": 0, "turns_per_s": 1.0}])


def test_the_pull_line_is_the_trainers() -> None:
    line = "2026-12-04 03:22:16,887 I MainProcess earl_stream.workers.trainer: step 1: 4 images pulled (1116 bytes of " \
           "PNG, of the step's 2232)"
    m = PULL_LINE.search(line)
    assert m is not None and tuple(map(int, m.groups())) == (1, 4, 1116, 2232)
