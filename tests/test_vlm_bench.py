"""bench/vlm.py's summary of the KV-reuse part on given repeats: turns/s per arm with its 95% interval, the reuse
speedup as a ratio of means with its interval, a one-repeat check run without intervals, runs of unknown arms
refused; its parsing of the trainer's pull lines; the learning part's per-seed keys; and a skipped part's keys
kept from the file a run rewrites, with the provenance they were measured at."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from provenance import keep_parts  # noqa: E402
from stats import mean_ci95, ratio_ci95  # noqa: E402
from vlm import KV_KEYS, LEARN_KEYS, PULL_KEYS, PULL_LINE, summarise_kv, summarise_learning  # noqa: E402

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


def _learned(seed: int, to_target: float | None, final: float) -> dict:
    return {"seed": seed, "seconds_to_target": to_target, "final_win_rate": final, "start_win_rate": 0.5}


def test_the_learning_keys_are_per_seed_with_means_when_every_seed_has_one() -> None:
    runs = [_learned(0, 112.2, 0.92), _learned(1, 150.0, 0.88), _learned(2, 98.0, 0.90)]
    out = summarise_learning(runs, 0.8)
    assert out["seconds_to_0_8"] == [112.2, 150.0, 98.0] and out["final_win_rate"] == [0.92, 0.88, 0.90]
    assert out["learning"]["seconds_to_target"] == mean_ci95([112.2, 150.0, 98.0])
    assert out["learning"]["final_win_rate"] == mean_ci95([0.92, 0.88, 0.90])
    missed = summarise_learning([_learned(0, 112.2, 0.92), _learned(1, None, 0.7)], 0.8)
    assert missed["seconds_to_0_8"] == [112.2, None] and "seconds_to_target" not in missed["learning"]


def test_a_skipped_part_keeps_its_keys_and_their_provenance() -> None:
    previous = {"kv_reuse": {"runs": {}}, "kv_reuse_speedup": {"ratio": 1.25}, "model": {"family": "idefics3"},
                "repeats": 3, "pull": {"dp2": {}}, "pull_bytes_fraction": {"dp2": 0.5}, "final_win_rate": None,
                "not_measured": {"final_win_rate": "not built"}, "provenance": {"commit": "a569031"}}
    learned = {"final_win_rate": [0.9], "seconds_to_0_8": [112.2]}
    out = keep_parts(previous, learned, {"kv_reuse": KV_KEYS, "pull": PULL_KEYS}, shared=("model", "repeats"))
    assert out["kv_reuse_speedup"] == {"ratio": 1.25} and out["pull_bytes_fraction"] == {"dp2": 0.5}
    assert out["final_win_rate"] == [0.9] and "not_measured" not in out  # the part that ran replaces its keys
    assert out["part_provenance"] == {"kv_reuse": {"commit": "a569031"}, "pull": {"commit": "a569031"}}
    again = keep_parts({**out, "provenance": {"commit": "ffff"}}, {"kv_reuse_speedup": {"ratio": 1.3}},
                       {"pull": PULL_KEYS, "learning": LEARN_KEYS}, shared=("model", "repeats"))
    assert again["part_provenance"]["pull"] == {"commit": "a569031"}  # kept at the commit it was measured at
    assert again["part_provenance"]["learning"] == {"commit": "ffff"} and again["seconds_to_0_8"] == [112.2]
