"""bench/real_scale.py's comparison across repeats: end-to-end wall time, per-phase rates with 95%
intervals, and which phases ran the same plan on both sides.

Pure arithmetic over the runs `real_scale.summarize` recorded (one dict per strategy and repeat); it starts
nothing. A phase where the adaptive run and the static plan it is compared with ran the same plan (layout and
recomputation) is `same_plan`: its ratio is run-to-run spread, never counted as a speedup or a loss.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from stats import mean_ci95, ratio_ci95

Run = dict[str, Any]


def end_to_end_seconds(run: Run) -> float | None:
    """Wall seconds from the start of the first trained step to the end of the last (re-plans, switches and
    idle waits included); None for a run that crashed, stopped early or trained nothing."""
    steps = run.get("step_log") or []
    if not steps or run.get("crashed") or run.get("stopped") or not run.get("started", True):
        return None
    return round(steps[-1]["t"] - (steps[0]["t"] - steps[0]["seconds"]), 2)


def plan_of_step(run: Run, step: int) -> str:
    """The plan (layout and recomputation, e.g. "fsdp2+rc") that trained logged step `step` ("step N: loss",
    the claim of step N - 1): the last one adopted at or before that claim."""
    plan = ""
    for a in run.get("adopted") or []:
        if a["step"] <= step - 1:
            plan = a["plan"]
    return plan


def phase_plans(run: Run, levels: int) -> list[str]:
    """Per context phase, the plans its steps ran, in order (" -> " between them); "" for a phase not trained."""
    out: list[list[str]] = [[] for _ in range(levels)]
    for st in run.get("step_log") or []:
        plans = out[st["phase"]]
        plan = plan_of_step(run, st["step"])
        if not plans or plans[-1] != plan:
            plans.append(plan)
    return [" -> ".join(p) for p in out]


def _interval(values: Sequence[float]) -> dict[str, float]:
    """mean_ci95 where there are 2 or more values; else just the mean and n (a single repeat has no interval)."""
    if len(values) >= 2:
        return {k: round(v, 3) for k, v in mean_ci95(values).items()}
    return {"mean": round(values[0], 3), "n": 1} if values else {"n": 0}


def _survived(run: Run, phase: int) -> bool:
    """Trained phase `phase` and did not crash (or stop) in it."""
    return bool(run.get("started")) and run["phases"][phase]["steps"] > 0 and run.get("crash_phase") != phase


def _phase_seconds(run: Run, phase: int) -> float:
    """Seconds the steps of `phase` took (step times only: what a plan choice changes)."""
    return sum(st["seconds"] for st in run.get("step_log") or [] if st["phase"] == phase)


def static_oracle(static: dict[str, list[Run]], best: str | None, levels: int) -> dict[str, Any] | None:
    """The ceiling of a choice among the static plans: each phase trained by the static plan fastest in it (mean
    step seconds over its repeats) among those that survived that phase in every repeat, switches free.
    `vs_best_static`: the best static plan's step seconds over the oracle's. A selector beats it only by running
    what no static plan ran (e.g. a plan at a micro-batch budget that survives a phase its static run did not)."""
    if best is None:
        return None
    choice: list[str] = []
    seconds = 0.0
    for k in range(levels):
        alive = {n: statistics.fmean(_phase_seconds(r, k) for r in runs) for n, runs in static.items()
                 if runs and all(_survived(r, k) for r in runs)}
        if not alive:
            return None
        name = min(alive, key=lambda n: alive[n])
        choice.append(name)
        seconds += alive[name]
    mine = sum(statistics.fmean(_phase_seconds(r, k) for r in static[best]) for k in range(levels))
    return {"phase_plans": choice, "step_seconds": round(seconds, 2), "best_static_step_seconds": round(mine, 2),
            "vs_best_static": round(mine / seconds, 3) if seconds else None}


def summarize_repeats(repeats: dict[str, list[Run]], levels: int, dynamic_sp_real: bool = False) -> dict[str, Any]:
    """The result's keys over every strategy's repeats (`repeats`: strategy -> its runs, first repeat first).

    `vs_best_static_end_to_end`: the best crash-free static plan's mean end-to-end seconds over the adaptive
    run's (> 1: adaptive faster), with the 95% interval of that ratio; `phase_vs_fastest_static`: per phase,
    adaptive's mean tokens/s over the fastest static plan that survived the phase, `same_plan` where both ran
    the same plan; `static_oracle`: how much a selector choosing among the static plans per phase could gain.
    """
    static = {k.split(":", 1)[1]: runs for k, runs in repeats.items() if k.startswith("static:")}
    adaptive = repeats.get("adaptive") or []
    e2e = {k: [s for r in runs if (s := end_to_end_seconds(r)) is not None] for k, runs in repeats.items()}
    # crash-free in every repeat, and trained to the end in each
    survivors = {n: runs for n, runs in static.items()
                 if runs and all(end_to_end_seconds(r) is not None for r in runs)}
    best = min(survivors, key=lambda n: statistics.fmean(e2e[f"static:{n}"]), default=None)
    versus_e2e: dict[str, Any] | None = None
    mine = e2e.get("adaptive") or []
    if best is not None and mine:
        theirs = e2e[f"static:{best}"]
        versus_e2e = {"best_static": best, "ratio": round(statistics.fmean(theirs) / statistics.fmean(mine), 3),
                      "adaptive_seconds": _interval(mine), "best_static_seconds": _interval(theirs)}
        if len(mine) >= 2 and len(theirs) >= 2:
            ci = ratio_ci95(theirs, mine)
            versus_e2e["ci95"] = [round(ci["low"], 3), round(ci["high"], 3)]
    per_phase: dict[str, list[dict[str, Any]]] = {}
    for kind, runs in repeats.items():
        rows = []
        for k in range(levels):
            rates = [r["phases"][k]["tokens_per_s"] for r in runs if r.get("started") and r["phases"][k].get("tokens_per_s")]
            plans = sorted({phase_plans(r, levels)[k] for r in runs if r.get("started")} - {""})
            rows.append({"phase": k, "plan": " | ".join(plans), "tokens_per_s": _interval(rates)})
        per_phase[kind] = rows
    versus_phase, same = [], []
    for k in range(levels):
        alive = [(n, per_phase[f"static:{n}"][k]) for n, runs in static.items()
                 if runs and all(_survived(r, k) for r in runs) and per_phase[f"static:{n}"][k]["tokens_per_s"].get("mean")]
        row: dict[str, Any] = {"phase": k, "fastest_static": None, "ratio": None, "same_plan": False}
        mine_k = per_phase["adaptive"][k] if adaptive else None
        if alive and mine_k and mine_k["tokens_per_s"].get("mean"):
            name, theirs_k = max(alive, key=lambda x: x[1]["tokens_per_s"]["mean"])
            row.update(fastest_static=name, adaptive_plan=mine_k["plan"], static_plan=theirs_k["plan"],
                       ratio=round(mine_k["tokens_per_s"]["mean"] / theirs_k["tokens_per_s"]["mean"], 3),
                       same_plan=mine_k["plan"] == theirs_k["plan"])
            if row["same_plan"]:
                same.append(k)
        versus_phase.append(row)
    rewards = {kind: [_phase_reward(runs, k) for k in range(levels)] for kind, runs in repeats.items()}
    differing = [p["ratio"] for p in versus_phase if p["ratio"] is not None and not p["same_plan"]]
    return {
        "repeats": {kind: len(runs) for kind, runs in repeats.items()},
        "end_to_end_seconds": e2e,
        "vs_best_static_end_to_end": versus_e2e,
        "static_oracle": static_oracle(static, best, levels),
        "per_phase": per_phase,
        "phase_vs_fastest_static": versus_phase,
        "same_plan_phases": same,
        # the worst phase where the plans differ (None: every compared phase ran the same plan)
        "vs_fastest_static_min_differing": min(differing) if differing else None,
        "reward_per_phase": rewards,
        "dynamic_sp_real": dynamic_sp_real,
    }


def tuning(caps: dict[str, Any], versus: dict[str, Any] | None) -> dict[str, Any]:
    """What finding each static plan's token cap cost (`token_caps`' probes, OOM-killed ones included: the
    user's trial and error the adaptive arm does not need), and the best static plan's end-to-end seconds with
    that cost added over adaptive's (`vs_best_static_with_tuning`; None without a comparison)."""
    seconds = {plan: round(sum(p.get("wall_seconds") or 0 for p in c.get("probes") or []), 1) for plan, c in caps.items()}
    ratio = None
    if versus and versus.get("best_static") in seconds:
        best = versus["best_static_seconds"]["mean"] + seconds[versus["best_static"]]
        ratio = round(best / versus["adaptive_seconds"]["mean"], 3)
    return {"tuning_seconds": seconds, "vs_best_static_with_tuning": ratio}


def _phase_reward(runs: list[Run], phase: int) -> float | None:
    """Mean reward of the steps of `phase` over every repeat (None where no step logged one)."""
    values = [st["reward"] for r in runs for st in r.get("step_log") or [] if st["phase"] == phase and "reward" in st]
    return round(statistics.fmean(values), 4) if values else None
