"""bench/e2e.py's summaries on recorded runs: async over the ceiling its own pools allow, async over sync and
TRL with intervals computed by hand, time to target against TRL (null when a run never got there), the
staleness ablation per seed; and the trainer log's loss tokens read back."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from e2e import fastest_threads, summarise_comparison, summarise_staleness  # noqa: E402
from pipeline_rates import trainer_steps  # noqa: E402
from stats import t975  # noqa: E402


def _earl(steps_per_s: float, rollout: float, trainer: float, samples: float, loss: float, target: float | None) -> dict:
    return {"steps_per_s": steps_per_s, "cpu_seconds_per_step": {"rollout": rollout, "trainer": trainer, "supervisor": 0.1},
            "samples_per_s": samples, "loss_tokens_per_s": loss, "time_to_target_s": target}


def _runs() -> dict:
    return {"async": [_earl(0.8, 0.5, 1.15, 51.2, 400.0, 150.0), _earl(0.85, 0.5, 1.1, 54.4, 420.0, 140.0),
                      _earl(0.9, 0.45, 1.05, 57.6, 440.0, 160.0)],
            "sync": [_earl(0.5, 0.3, 0.7, 32.0, 250.0, 200.0), _earl(0.55, 0.3, 0.7, 35.2, 270.0, 210.0),
                     _earl(0.5, 0.3, 0.7, 32.0, 260.0, 190.0)],
            "trl": [{"samples_per_s": 60.0, "loss_tokens_per_s": 120.0, "time_to_target_s": 300.0, "steps_per_s": 0.9},
                    {"samples_per_s": 62.0, "loss_tokens_per_s": 125.0, "time_to_target_s": 320.0, "steps_per_s": 0.95},
                    {"system": "trl", "error": "killed"}]}


def test_comparison_intervals_and_the_ceiling_of_each_async_run() -> None:
    s = summarise_comparison(_runs())
    per_run = [0.8 * 1.15, 0.85 * 1.1, 0.9 * 1.05]  # steps/s x the larger pool's CPU seconds per step
    assert s["async_vs_ceiling_per_run"] == pytest.approx(per_run)
    half = t975(2) * statistics.stdev(per_run) / math.sqrt(3)
    assert s["async_vs_ceiling"]["mean"] == pytest.approx(statistics.fmean(per_run))
    assert s["async_vs_ceiling"]["ci95"] == pytest.approx([statistics.fmean(per_run) - half, statistics.fmean(per_run) + half])
    ratio = statistics.fmean([51.2, 54.4, 57.6]) / statistics.fmean([32.0, 35.2, 32.0])
    lo, hi = s["async_vs_sync"]["ci95"]
    assert s["async_vs_sync"]["mean"] == pytest.approx(ratio) and lo < ratio < hi
    # the failed TRL run is counted, not averaged
    assert s["failed_runs"] == {"async": 0, "sync": 0, "trl": 1} and s["samples_per_s"]["trl"]["n"] == 2
    assert s["time_to_target_vs_trl"]["default_model"]["mean"] == pytest.approx(150 / 310)
    assert s["time_to_target_vs_trl"]["smollm2"] is None and s["loss_tokens_per_s"]["async"]["mean"] == pytest.approx(420)


def test_a_run_that_never_reached_the_target_gives_no_time_ratio() -> None:
    runs = _runs()
    runs["trl"][1]["time_to_target_s"] = None
    s = summarise_comparison(runs)
    assert s["time_to_target_vs_trl"]["default_model"] is None
    assert any("did not reach the target" in n for n in s["notes"])


def test_when_only_trl_never_reached_the_target_its_run_length_bounds_the_ratio() -> None:
    runs = _runs()
    for r in runs["trl"]:
        r.update(time_to_target_s=None, startup_s=20.0, window_s=280.0)
    s = summarise_comparison(runs)
    bound = s["time_to_target_vs_trl"]["default_model"]
    assert bound["mean"] is None and bound["trl_reached"] is False
    assert bound["at_most"] == pytest.approx(150 / 300)
    assert any("`at_most` bounds the ratio" in n for n in s["notes"])


def test_staleness_ablation_keeps_every_seed() -> None:
    ablation = {"0": [{"time_to_target_s": 300.0, "final_win_rate": 0.91}, {"time_to_target_s": 280.0, "final_win_rate": 0.92}],
                "4": [{"time_to_target_s": None, "final_win_rate": 0.85}, {"time_to_target_s": 200.0, "final_win_rate": 0.93}]}
    s = summarise_staleness(ablation)
    assert s["0"]["seconds_to_target"] == [300.0, 280.0] and s["0"]["seconds_to_target_mean"]["mean"] == 290.0
    assert s["4"]["seconds_to_target_mean"] is None and s["4"]["final_win_rate"] == [0.85, 0.93]
    assert s["4"]["final_win_rate_mean"]["mean"] == pytest.approx(0.89)


def test_the_trainer_log_carries_loss_tokens(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text(
        "2026-12-04 15:00:00,000 INFO step 1: loss 0.1 grad-norm 0.2 reward 0.5 (64 samples, 6400 tokens) in 1.00s "
        "(pull 0.010s); clipped 0.0 |ratio-1| 0.0 masked 0.0 (stale 0.0); 812 loss tokens\n"
        "2026-12-04 15:00:02,000 INFO step 2: loss 0.1 grad-norm 0.2 reward 0.5 (64 samples, 6400 tokens) in 1.00s "
        "(pull 0.010s); clipped 0.0 |ratio-1| 0.0 masked 0.0 (stale 0.0)\n")
    steps = trainer_steps(log)
    assert steps[1].loss_tokens == 812 and steps[1].tokens == 6400 and steps[2].loss_tokens is None


def test_one_part_keeps_the_other_parts_keys_from_the_file_it_replaces():
    from e2e import keep_other_part

    comparison = {"model": "m", "target_win_rate": 0.9, "async_vs_ceiling": {"mean": 0.97}, "runs": {"async": []},
                  "part_wall_seconds": {"comparison": 2400.0}, "provenance": {"commit": "c0"}}
    staleness = {"model": "m", "target_win_rate": 0.9, "staleness_ablation": {"0": {}}, "ablation_seconds": 240.0,
                 "part_wall_seconds": {"staleness": 4200.0}}
    merged = keep_other_part(comparison, staleness, "staleness")
    assert merged["async_vs_ceiling"] == {"mean": 0.97} and merged["staleness_ablation"] == {"0": {}}
    assert merged["part_wall_seconds"] == {"comparison": 2400.0, "staleness": 4200.0}
    assert merged["part_provenance"] == {"comparison": {"commit": "c0"}}  # the kept part's, not the new one's
    # the other way round: the staleness file's ablation stays beside a new comparison
    again = keep_other_part(merged, {**comparison, "async_vs_ceiling": {"mean": 0.99}}, "comparison")
    assert again["async_vs_ceiling"] == {"mean": 0.99} and again["staleness_ablation"] == {"0": {}}
    # an old-format file (no key of this format) or another model: replaced whole
    old = {"model": "m", "target_win_rate": 0.9, "async_vs_sync": 1.53, "time_to_target_s": {}}
    assert keep_other_part(old, staleness, "staleness") == staleness
    assert keep_other_part({**comparison, "model": "other"}, staleness, "staleness") == staleness


def test_the_thread_probe_keeps_the_faster_count_and_the_fewest_among_equals() -> None:
    """The sync and TRL baselines are tuned before the campaign: the faster probe wins, a failed probe never does,
    and ties (or every probe failed) keep the fewest threads."""
    assert fastest_threads({1: 30.0, 2: 3.1}) == 1
    assert fastest_threads({1: 20.0, 2: 31.5}) == 2
    assert fastest_threads({1: None, 2: 3.1}) == 2
    assert fastest_threads({1: 5.0, 2: 5.0}) == 1
    assert fastest_threads({1: None, 2: None}) == 1


def test_a_resumed_ablation_keeps_its_runs_by_setting_and_seed_and_refuses_other_lengths() -> None:
    """`--part staleness --resume`: the runs of a previous file are kept by (max_staleness, seed), so the ablation
    can span sessions; a file measured with another run length or target is refused, not mixed in."""
    from e2e import kept_ablation_runs

    runs = {"0": [{"seed": 0, "time_to_target_s": 250.0, "final_win_rate": 0.91}],
            "4": [{"seed": 0, "time_to_target_s": None, "final_win_rate": 0.85},
                  {"seed": 1, "time_to_target_s": 230.0, "final_win_rate": 0.92}]}
    previous = {"ablation_seconds": 240.0, "target_win_rate": 0.9, "staleness_ablation": summarise_staleness(runs)}
    kept = kept_ablation_runs(previous, 240.0, 0.9)
    assert set(kept) == {("0", 0), ("4", 0), ("4", 1)} and kept[("4", 1)]["time_to_target_s"] == 230.0
    assert kept_ablation_runs({"async_vs_ceiling": {}}, 240.0, 0.9) == {}
    with pytest.raises(SystemExit, match="not 300.0 s to 0.9"):
        kept_ablation_runs(previous, 300.0, 0.9)


def test_the_trl_arm_reports_the_window_after_its_first_step_in_the_same_units() -> None:
    """bench/e2e_trl.py's result on a recorded clock: samples/s and loss tokens/s (the trained first moves) over
    the steps after the first, and the time to the target over its own window of games."""
    from types import SimpleNamespace

    from e2e_trl import Setting, trl_result

    setting = Setting(group_size=2, groups_per_step=2, window=4)  # 4 samples (games) a step
    ends = [10.0, 12.0, 14.0, 16.0]  # the first step ends at 10 s; 3 steps in the 6 s after it
    clock = SimpleNamespace(ends=ends, snapshots=[(0.0, 0.0, 0, 0.0), (1.0, 2.0, 30, 0.0), (2.0, 4.0, 60, 0.0),
                                                  (3.0, 6.0, 90, 9.0)],
                            logs=[{"completions/mean_length": 2.0}] * 4)
    outcomes = [(10.0 + i, "win" if i >= 6 else "loss") for i in range(16)]
    out = trl_result(clock, SimpleNamespace(outcomes=outcomes), 0.9, 2, "0.0", setting)  # type: ignore[arg-type]
    assert out["steps"] == 3 and out["samples_per_s"] == pytest.approx(12 / 6)
    assert out["loss_tokens_per_s"] == pytest.approx(3 * 2.0 * 4 / 6)  # each step's 4 first moves of 2 tokens
    assert out["generated_tokens_per_s"] == pytest.approx((24 + 90) / 6)  # trained moves + the playouts' tokens
    # windows of 4 games every 4: games 0-3 (0 wins), 4-7 (2), 8-11 (4 = 1.0 >= 0.9: reached at game 11's time)
    assert [p["win"] for p in out["curve"]] == [0.0, 0.5, 1.0, 1.0] and out["time_to_target_s"] == 21.0
    assert out["cpu_seconds_per_sample"] == pytest.approx(9.0 / 12)


def _smollm2_runs() -> dict[str, list[dict]]:
    """Two seeds a system; checkpoints every 2 steps, one TRL checkpoint past the 600 s budget."""
    def ckpts(system: str, seed: int, times: list[float]) -> list[dict]:
        return [{"step": 2 * (i + 1), "t": t, "path": f"{system}{seed}/{i}"} for i, t in enumerate(times)]
    return {"earl_stream": [{"seed": s, "loss_tokens_per_s": 40.0 + s, "checkpoints": ckpts("e", s, [150, 300, 450, 590])}
                            for s in (0, 1)],
            "trl": [{"seed": s, "loss_tokens_per_s": 30.0 + s, "checkpoints": ckpts("t", s, [250, 500, 640])}
                    for s in (0, 1)]}


def test_smollm2_evaluations_score_the_last_checkpoint_then_search_forward_to_the_first_hit() -> None:
    """Part smollm2's evaluation order: the base, each run's last checkpoint within the budget (one past it never),
    then each run's checkpoints in time order up to the first at or above the target; `curves` scores the rest;
    a second pass (a resumed stage) measures nothing again."""
    from e2e_smollm2 import evaluate_runs

    success = {"base": 0.14, "e0/0": 0.15, "e0/1": 0.25, "e0/2": 0.20, "e0/3": 0.30, "e1/0": 0.16, "e1/1": 0.2,
               "e1/2": 0.22, "e1/3": 0.23, "t0/0": 0.17, "t0/1": 0.24, "t0/2": 0.9, "t1/0": 0.1, "t1/1": 0.2,
               "t1/2": 0.9}
    measured: list[str] = []

    def measure(path: str) -> dict:
        measured.append(path)
        return {"success": success[path]}

    evals: dict = {}
    evaluate_runs(_smollm2_runs(), evals, "base", 600.0, 0.10, measure, lambda e: None)
    assert measured == ["base", "e0/3", "e1/3", "t0/1", "t1/1", "e0/0", "e0/1", "e1/0", "e1/1", "e1/2", "t0/0",
                        "t1/0"]
    evaluate_runs(_smollm2_runs(), evals, "base", 600.0, 0.10, measure, lambda e: None)
    assert len(measured) == 12
    evaluate_runs(_smollm2_runs(), evals, "base", 600.0, 0.10, measure, lambda e: None, curves=True)
    assert measured[12:] == ["e0/2"]


def test_smollm2_summary_times_to_target_and_bounds_the_ratio_when_trl_never_reached() -> None:
    from e2e_smollm2 import summarise
    from stats import ratio_ci95

    runs = _smollm2_runs()
    evals = {"base": {"success": 0.14}, "e0/3": {"success": 0.30}, "e0/0": {"success": 0.15}, "e0/1": {"success": 0.25},
             "e1/3": {"success": 0.24}, "e1/0": {"success": 0.24}, "t0/1": {"success": 0.20}, "t1/1": {"success": 0.18},
             "t0/0": {"success": 0.17}, "t1/0": {"success": 0.1}, "t0/2": {"success": 0.9}}  # t0/2: past the budget
    out = summarise(runs, evals, "base", 0.10, 600.0)
    assert out["time_to_target_s"] == {"earl_stream": [300, 150], "trl": [None, None]}
    assert out["time_to_target_vs_trl"]["mean"] is None
    assert out["time_to_target_vs_trl"]["at_most"] == pytest.approx(225 / 600)
    assert out["heldout_at_budget_per_seed"] == {"earl_stream": [0.30, 0.24], "trl": [0.20, 0.18]}
    assert out["heldout_at_budget"]["trl"]["mean"] == pytest.approx(0.19)
    m = statistics.fmean([40.0, 41.0])
    assert out["loss_tokens_per_s"]["earl_stream"]["mean"] == pytest.approx(m)
    # both systems reached it in every run: the ratio of means with its interval
    evals.update({"t0/1": {"success": 0.25}, "t1/1": {"success": 0.26}, "t0/0": {"success": 0.2}, "t1/0": {"success": 0.3}})
    out = summarise(_smollm2_runs(), evals, "base", 0.10, 600.0)
    assert out["time_to_target_s"]["trl"] == [500, 250]
    r = ratio_ci95([300, 150], [500, 250])
    assert out["time_to_target_vs_trl"]["mean"] == pytest.approx(r["ratio"])
    assert out["time_to_target_vs_trl"]["ci95"] == pytest.approx([r["low"], r["high"]])
    # a run not evaluated yet: no ratio, and a note says why
    del evals["e1/3"], evals["e1/0"]
    out = summarise(_smollm2_runs(), evals, "base", 0.10, 600.0)
    assert out["time_to_target_vs_trl"] is None and out["heldout_at_budget_per_seed"]["earl_stream"] == [0.30, None]
    assert out["time_to_target_unknown"] == ["earl_stream seed 1"]
    # a TRL run whose earlier checkpoints are unscored is unknown, never "did not reach": no bound is claimed
    evals = {"base": {"success": 0.14}, **{f"e{s}/0": {"success": 0.3} for s in (0, 1)},
             **{f"e{s}/3": {"success": 0.3} for s in (0, 1)}, "t0/1": {"success": 0.2}, "t1/1": {"success": 0.2},
             "t0/0": {"success": 0.2}}
    out = summarise(_smollm2_runs(), evals, "base", 0.10, 600.0)
    assert out["time_to_target_s"]["trl"] == [None, None] and out["time_to_target_unknown"] == ["trl seed 1"]
    assert out["time_to_target_vs_trl"] is None


def test_the_smollm2_part_is_kept_beside_the_default_model_parts_and_fills_its_ratio() -> None:
    from e2e import keep_other_part

    previous = {"model": "m", "target_win_rate": 0.9, "async_vs_ceiling": {"mean": 0.9}, "runs": {"async": []},
                "time_to_target_vs_trl": {"default_model": {"at_most": 0.47}, "smollm2": None},
                "notes": ["default: bounded", "time_to_target_vs_trl.smollm2 is not measured by this script yet"],
                "part_wall_seconds": {"comparison": 2500.0}, "provenance": {"commit": "c0"}}
    smollm2 = {"model": "m", "target_win_rate": 0.9, "smollm2": {"time_to_target_vs_trl": {"mean": 0.6}},
               "part_wall_seconds": {"smollm2": 4000.0}}
    merged = keep_other_part(previous, smollm2, "smollm2")
    assert merged["time_to_target_vs_trl"] == {"default_model": {"at_most": 0.47}, "smollm2": {"mean": 0.6}}
    assert merged["async_vs_ceiling"] == {"mean": 0.9} and merged["part_provenance"] == {"comparison": {"commit": "c0"}}
    assert merged["notes"] == ["default: bounded"]  # the part that measures the ratio owns what is said of it
    again = keep_other_part(merged, {**previous, "async_vs_ceiling": {"mean": 0.95}, "provenance": {"commit": "c1"},
                                     "part_wall_seconds": {"comparison": 2400.0}}, "comparison")
    assert again["smollm2"] == {"time_to_target_vs_trl": {"mean": 0.6}}
    assert again["time_to_target_vs_trl"]["smollm2"] == {"mean": 0.6}
    assert again["part_wall_seconds"] == {"comparison": 2400.0, "smollm2": 4000.0}
