"""bench/real_scale.py's comparison across repeats (bench/real_scale_summary.py): on the runs recorded on
2026-11-28 every phase ran the same plan on both sides (so no phase counts as a speedup or a loss) and the
adaptive run was slower end to end; on repeats whose plans differ, the ratio carries its 95% interval."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from real_scale_summary import end_to_end_seconds, phase_plans, summarize_repeats, tuning  # noqa: E402

RECORDED = Path(__file__).resolve().parent / "bench_data" / "real_scale_runs_2026-11-28.json"


def _recorded() -> tuple[dict, int]:
    data = json.loads(RECORDED.read_text())
    return data["runs"], data["levels"]


def test_recorded_runs_ran_the_same_plan_in_every_phase_and_lost_end_to_end() -> None:
    runs, levels = _recorded()
    s = summarize_repeats({k: [r] for k, r in runs.items()}, levels)
    assert phase_plans(runs["adaptive"], levels) == ["dp2", "dp2", "fsdp2", "fsdp2+rc"]
    assert s["same_plan_phases"] == [0, 1, 2, 3]
    assert all(p["same_plan"] for p in s["phase_vs_fastest_static"])
    assert s["vs_fastest_static_min_differing"] is None  # nothing left to call a speedup
    # end to end (first step's start to last step's end): 834 s against the static plans with recomputation
    assert s["end_to_end_seconds"]["adaptive"] == [pytest.approx(834.2, abs=0.5)]
    assert s["end_to_end_seconds"]["static:dp2"] == []  # crashed: no end-to-end time
    e2e = s["vs_best_static_end_to_end"]
    assert e2e["best_static"] in ("dp2+rc", "fsdp2+rc") and e2e["ratio"] == pytest.approx(0.79, abs=0.01)
    assert "ci95" not in e2e  # one repeat: no interval, and none is invented
    assert s["repeats"]["adaptive"] == 1 and s["dynamic_sp_real"] is False


def _shifted(run: dict, factor: float, plan: str | None = None) -> dict:
    """A copy of `run` whose steps took `factor` x as long (and, optionally, ran `plan` from the start)."""
    out = copy.deepcopy(run)
    t0 = out["step_log"][0]["t"] - out["step_log"][0]["seconds"]
    for st in out["step_log"]:
        st["seconds"] *= factor
        st["t"] = t0 + (st["t"] - t0) * factor
    for ph in out["phases"]:
        if ph.get("tokens_per_s"):
            ph["tokens_per_s"] /= factor
    if plan is not None:
        out["adopted"] = [{"step": 0, "version": 2, "plan": plan, "micro_batch_tokens": 65536}]
    return out


def test_differing_plans_are_compared_with_intervals_over_repeats() -> None:
    runs, levels = _recorded()
    adaptive, static = runs["adaptive"], runs["static:fsdp2+rc"]
    # the adaptive arm 20% faster than a static plan that ran something else (dp2+rc) in every phase
    repeats = {"adaptive": [_shifted(adaptive, f) for f in (0.60, 0.62, 0.61)],
               "static:dp2+rc": [_shifted(static, f, plan="dp2+rc") for f in (0.92, 0.91, 0.93)]}
    s = summarize_repeats(repeats, levels)
    assert s["same_plan_phases"] == []
    e2e = s["vs_best_static_end_to_end"]
    assert e2e["best_static"] == "dp2+rc" and len(e2e["ci95"]) == 2 and 1.0 < e2e["ci95"][0] < e2e["ratio"] < e2e["ci95"][1]
    assert s["per_phase"]["adaptive"][3]["tokens_per_s"]["n"] == 3 and "low" in s["per_phase"]["adaptive"][3]["tokens_per_s"]
    assert s["vs_fastest_static_min_differing"] is not None
    assert all(end_to_end_seconds(r) for r in repeats["adaptive"])


def test_an_arm_identical_to_a_static_plan_is_never_a_speedup_and_same_plan_phases_never_count() -> None:
    runs, levels = _recorded()
    static = runs["static:fsdp2+rc"]
    plan = phase_plans(static, levels)[0]
    # the adaptive arm ran exactly what the static plan ran, as fast, over 3 repeats each
    repeats = {"adaptive": [_shifted(static, f) for f in (0.99, 1.0, 1.01)],
               "static:fsdp2+rc": [_shifted(static, f) for f in (1.01, 1.0, 0.99)]}
    s = summarize_repeats(repeats, levels, dynamic_sp_real=True)
    assert s["same_plan_phases"] == list(range(levels)) and plan
    assert s["vs_fastest_static_min_differing"] is None
    e2e = s["vs_best_static_end_to_end"]
    assert e2e["ratio"] == pytest.approx(1.0, abs=1e-3) and e2e["ci95"][0] < 1.0 < e2e["ci95"][1]
    assert s["dynamic_sp_real"] is True and s["repeats"] == {"adaptive": 3, "static:fsdp2+rc": 3}
    # one phase where the adaptive arm ran another plan: only that phase is compared
    faster = [_shifted(static, f) for f in (0.5, 0.51, 0.49)]
    for r in faster:
        r["adopted"] = [*r["adopted"], {"step": r["step_log"][-1]["step"] - 1, "version": 99, "plan": "dp2+rc",
                                        "micro_batch_tokens": 4096}]
    s = summarize_repeats({"adaptive": faster, "static:fsdp2+rc": repeats["static:fsdp2+rc"]}, levels)
    last = s["phase_vs_fastest_static"][levels - 1]
    assert not last["same_plan"] and levels - 1 not in s["same_plan_phases"]
    assert s["vs_fastest_static_min_differing"] == last["ratio"]


def test_the_campaign_runs_a_first_pass_then_interleaved_repeats_and_resumes_where_it_stopped() -> None:
    """bench/real_scale.next_run: every strategy once, then A B A B over those that may repeat (a static plan
    that crashed in the first pass does not); a campaign resumed from its recorded runs continues, not restarts."""
    from real_scale import next_run

    kinds = ["adaptive", "static:dp2", "static:fsdp2+rc"]
    ok = {"started": True, "crashed": False, "stopped": False}
    runs: dict = {}
    later: dict = {}
    order = []
    while (due := next_run(kinds, runs, later, 3)) is not None:
        kind, repeat = due
        order.append(due)
        if repeat == 0:
            runs[kind], later[kind] = {**ok, "crashed": kind == "static:dp2"}, []
        else:
            later[kind].append(ok)
        if len(order) == 4:  # killed here: a resumed campaign starts from what the file holds
            runs, later = dict(runs), {k: list(v) for k, v in later.items()}
    assert order == [("adaptive", 0), ("static:dp2", 0), ("static:fsdp2+rc", 0), ("adaptive", 1),
                     ("static:fsdp2+rc", 1), ("adaptive", 2), ("static:fsdp2+rc", 2)]
    assert next_run(kinds, {}, {}, 1) == ("adaptive", 0)
    assert next_run(kinds, runs, later, 3) is None


def test_a_static_plan_oom_killed_at_its_cap_runs_again_at_half_of_it_down_to_the_longest_episode() -> None:
    """bench/real_scale.retune: only a static plan's first run, only after a crash, never below the longest episode
    (tp2 on heads8 survived its 2,048-token probes at 821 tokens, then died at 290 tokens with 7 rows a micro-batch)."""
    from real_scale import retune

    crashed, ok = {"crashed": True}, {"crashed": False}
    assert retune("static:tp2", 0, crashed, 2048, 821)
    assert not retune("static:tp2", 0, ok, 2048, 821)
    assert not retune("static:tp2", 1, crashed, 2048, 821)  # a repeat runs at the cap its first run settled on
    assert not retune("adaptive", 0, crashed, 2048, 821) and not retune("dynamic_sp", 0, crashed, 2048, 821)
    assert not retune("static:dp2", 0, crashed, 1024, 821)  # 512 tokens would refuse the longest episodes
    assert not retune("static:dp2", 0, crashed, 0, 821)  # no cap: nothing to lower


def test_the_benchmarks_page_shows_each_strategy_end_to_end_and_the_same_plan_phases() -> None:
    """bench/report_tables.render_real_scale on a summary of repeats: every strategy's end-to-end interval and
    per-phase plans, the end-to-end ratio with its interval, and the phases marked `same plan`."""
    from report_tables import render_real_scale

    runs, levels = _recorded()
    adaptive, static = runs["adaptive"], runs["static:fsdp2+rc"]
    repeats = {"adaptive": [_shifted(adaptive, f) for f in (0.60, 0.62, 0.61)],
               "static:fsdp2+rc": [_shifted(static, f) for f in (0.92, 0.91, 0.93)]}
    s = summarize_repeats(repeats, levels)
    page = "\n".join(render_real_scale({**s, "runs": {k: v[0] for k, v in repeats.items()},
                                        "token_caps": {"fsdp2+rc": {"tokens": 4096}}, "phase_episode_tokens": [92, 791]}))
    assert "| static:fsdp2+rc | 3 | no | 4,096 |" in page.replace("4096", "4,096")
    ratio = s["vs_best_static_end_to_end"]
    assert f"**{ratio['ratio']:.3g}x** [95% {ratio['ci95'][0]:.3g}, {ratio['ci95'][1]:.3g}]" in page
    same = [p["phase"] for p in s["phase_vs_fastest_static"] if p["same_plan"]]
    assert page.count("same plan |") == len(same) and "fsdp2+rc: " in page


def test_the_static_oracle_is_each_phase_trained_by_its_fastest_static_plan() -> None:
    runs, levels = _recorded()
    fast_early = _shifted(runs["static:dp2+rc"], 1.0)
    slow_late = _shifted(runs["static:fsdp2+rc"], 1.0)
    for st in fast_early["step_log"]:  # dp2+rc: half the time in phases 0-1, twice it in 2-3
        st["seconds"] *= 0.5 if st["phase"] < 2 else 2.0
    s = summarize_repeats({"adaptive": [runs["adaptive"]], "static:dp2+rc": [fast_early],
                           "static:fsdp2+rc": [slow_late]}, levels)
    oracle = s["static_oracle"]
    assert oracle["phase_plans"][:2] == ["dp2+rc", "dp2+rc"] and oracle["phase_plans"][2:] == ["fsdp2+rc"] * 2
    by_phase = [sum(st["seconds"] for st in r["step_log"] if st["phase"] == k) for r in (fast_early, slow_late)
                for k in range(levels)]
    early, late = by_phase[:levels], by_phase[levels:]
    assert oracle["step_seconds"] == pytest.approx(early[0] + early[1] + late[2] + late[3], abs=0.02)
    assert oracle["vs_best_static"] > 1.0  # mixing plans beats either one alone here
    # one plan fastest everywhere: the oracle is that plan, and no selector can beat it
    s = summarize_repeats({"adaptive": [runs["adaptive"]], "static:fsdp2+rc": [slow_late],
                           "static:dp2+rc": [_shifted(slow_late, 1.5, plan="dp2+rc")]}, levels)
    assert s["static_oracle"]["phase_plans"] == ["fsdp2+rc"] * levels and s["static_oracle"]["vs_best_static"] == 1.0


def test_tuning_counts_every_probe_of_the_best_static_plan_against_the_adaptive_run() -> None:
    caps = {"fsdp2": {"tokens": 1024, "probes": [{"tokens": 4096, "crashed": True, "wall_seconds": 74.4},
                                                  {"tokens": 1024, "survived": True, "wall_seconds": 268.5}]},
            "dp2": {"tokens": None, "probes": []}}
    versus = {"best_static": "fsdp2", "best_static_seconds": {"mean": 307.3}, "adaptive_seconds": {"mean": 315.4}}
    t = tuning(caps, versus)
    assert t["tuning_seconds"] == {"fsdp2": 342.9, "dp2": 0}
    assert t["vs_best_static_with_tuning"] == pytest.approx((307.3 + 342.9) / 315.4, abs=1e-3)
    assert tuning(caps, None)["vs_best_static_with_tuning"] is None


def test_a_static_plan_that_crashed_later_still_bounds_the_phases_it_survived() -> None:
    runs, levels = _recorded()
    crashed = runs["static:dp2"]["crash_phase"]
    assert crashed == 3  # OOM-killed in the last phase of the recorded run
    dp2 = _shifted(runs["static:dp2"], 1.0)
    for st in dp2["step_log"]:
        st["seconds"] *= 0.1  # far faster while it lasts
    s = summarize_repeats({"adaptive": [runs["adaptive"]], "static:dp2": [dp2],
                           "static:dp2+rc": [runs["static:dp2+rc"]]}, levels)
    assert s["static_oracle"]["phase_plans"] == ["dp2"] * crashed + ["dp2+rc"] * (levels - crashed)
    assert s["vs_best_static_end_to_end"]["best_static"] == "dp2+rc"  # the crashed plan is never the best static


def test_a_rebuilt_summary_keeps_when_and_where_its_runs_were_measured(tmp_path: Path) -> None:
    from provenance import write_result

    measured = {"when": "2026-12-06T09:58:32+00:00", "commit": "2243e195370b7b58f287e1f22935b802d0ff28f8",
                "dirty": False, "depends_on": ["bench/real_scale.py"]}
    out = write_result(tmp_path / "r.json", {"x": 1}, depends_on=["bench/real_scale.py"], measured=measured)
    prov = json.loads(out.read_text())["provenance"]
    assert {k: prov[k] for k in measured} == measured  # the measurement's, not this rebuild's
    assert prov["summary_rebuilt"]["commit"] and prov["summary_rebuilt"]["when"] != measured["when"]
    fresh = json.loads(write_result(tmp_path / "f.json", {"x": 1}, depends_on=["bench/real_scale.py"]).read_text())
    assert "summary_rebuilt" not in fresh["provenance"] and fresh["provenance"]["when"] != measured["when"]


def _run_of(seconds: float | None, crashed: bool = False) -> dict:
    """A run as real_scale_run.summarize records it, reduced to what the campaign's choices read."""
    steps = [] if seconds is None else [{"t": 1000.0 + seconds, "seconds": 10.0}]
    return {"started": True, "crashed": crashed, "stopped": False, "step_log": [{"t": 1010.0, "seconds": 10.0}, *steps]}


def test_the_campaign_repeats_the_fastest_static_plans_of_its_first_pass_and_any_that_beats_them() -> None:
    """bench/real_scale.repeated: adaptive and dynamic_sp always; of the static plans, the `top` fastest end to
    end in the first pass, and a plan run once whose time beats the fastest repeated plan's mean joins them (so the
    best static plan the comparison names always has repeats, whatever the machine's ranking)."""
    from real_scale import next_run, repeated

    kinds = ["adaptive", "dynamic_sp", "static:dp2", "static:fsdp2", "static:tp2", "static:sp2"]
    runs = {"adaptive": _run_of(400), "dynamic_sp": _run_of(450), "static:dp2": _run_of(None, crashed=True),
            "static:fsdp2": _run_of(380), "static:tp2": _run_of(390), "static:sp2": _run_of(395)}
    later: dict = {}
    assert repeated(kinds, runs, later, 2) == ["adaptive", "dynamic_sp", "static:fsdp2", "static:tp2"]
    assert repeated(kinds, runs, later, 0) == ["adaptive", "dynamic_sp", "static:fsdp2", "static:tp2", "static:sp2"]
    # fsdp2's repeats come out slow: sp2's one run (395 s) now beats the fastest repeated mean (tp2, 398 s)
    later = {"adaptive": [_run_of(400)], "dynamic_sp": [_run_of(450)], "static:fsdp2": [_run_of(430)],
             "static:tp2": [_run_of(406)]}
    assert repeated(kinds, runs, later, 2)[-1] == "static:sp2"
    assert next_run(kinds, runs, later, 3, 2) == ("static:sp2", 1)
    assert next_run(kinds, runs, later, 1, 2) is None


def test_a_resumed_campaign_keeps_only_what_was_measured_at_this_code_on_this_cpu() -> None:
    """bench/real_scale.keep_this_code: a run (or a probed token cap) recorded at another commit whose measured code
    differs, on another CPU, from a dirty checkout or with no record is measured again, not merged into the file."""
    from real_scale import keep_this_code

    from bench.provenance import run_stamp

    here = {**run_stamp(), "dirty": False}  # this commit and CPU (LICENSE, the measured path below, is unchanged)
    runs = {"adaptive": {"measured": here}, "static:tp2": {"measured": {**here, "cpu": "another CPU"}},
            "static:sp2": {}, "static:fsdp2": {"measured": {**here, "dirty": True}}}
    later = {"adaptive": [{"measured": here}, {"measured": {**here, "commit": "0" * 40}}], "static:tp2": [{}]}
    caps = {"tp2": {"tokens": 2048, "measured": here}, "sp2": {"tokens": 1024}, "fsdp2": {"tokens": 512, "given": True}}
    dropped = keep_this_code(runs, later, caps, ["LICENSE"])
    assert list(runs) == ["adaptive"] and later == {"adaptive": [{"measured": here}]}
    assert set(caps) == {"tp2", "fsdp2"}  # a cap given on the command line has no measurement to check
    assert len(dropped) == 5 and any("another CPU" in d for d in dropped)
