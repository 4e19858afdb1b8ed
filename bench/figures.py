"""The figures the README's results table and docs/results.md quote, computed from the results files, so that a
page cannot quote a number its file does not hold: `bench/report.py` writes both from here, and
tests/test_benchmarks_page.py regenerates them and compares. Each figure gives its worst and best case as the
file has them (the worst value of the quantity in the whole file, not of a chosen subset), the repeats and
intervals the benchmark recorded, and its conditions: one line for the README, the full setting for the docs.
A figure whose file is missing is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Load = Callable[[str], "dict[str, Any] | None"]


@dataclass(frozen=True)
class Figure:
    figure: str
    worst: str
    best: str
    files: tuple[str, ...]  # the results files it comes from (names under bench/results/)
    short: str  # the README's conditions
    details: str  # docs/results.md's benchmark and conditions
    part: str = ""  # the part of a result measured one part at a time it comes from ("": the whole file)


def _iv(x: dict[str, Any], digits: int = 2, unit: str = "", sign: str = "") -> str:
    """A mean with its 95% interval: {mean, ci95: [low, high]} or {mean, low, high}; `sign` "+" signs them. One
    measurement ({mean, n: 1}) has no interval and says so."""
    fmt = f"{sign}.{digits}f"
    if "ci95" not in x and "low" not in x:
        return f"{x['mean']:{fmt}}{unit} (one run, no interval)"
    low, high = x["ci95"] if "ci95" in x else (x["low"], x["high"])
    return f"{x['mean']:{fmt}}{unit} [{low:{fmt}}, {high:{fmt}}]"


def _ratio(x: dict[str, Any]) -> str:
    low, high = x["ci95"] if "ci95" in x else (x["low"], x["high"])
    return f"{x['ratio']:.2f}x [{low:.2f}, {high:.2f}]"


def _ends(by: dict[Any, Any], value: Callable[[Any], float] | None = None) -> tuple[Any, Any]:
    """The keys of the smallest and the largest value (of `value(v)` where given)."""
    key = (lambda k: value(by[k])) if value else by.__getitem__
    return min(by, key=key), max(by, key=key)


def _span(values: list[int]) -> str:
    """`low-high` of some token counts, or the one count they all are."""
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def _steps(per_phase: int | list[int]) -> str:
    """Steps per phase: one number where every phase has the same."""
    counts = per_phase if isinstance(per_phase, list) else [per_phase]
    return str(counts[0]) if len(set(counts)) == 1 else ", ".join(map(str, counts))


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def learning(load: Load) -> list[Figure]:
    d = load("learning")
    if d is None:
        return []
    t = d.get("time_to_target_s")
    first = f"{d['target_win_rate']} first at {t:.0f} s" if t is not None else f"{d['target_win_rate']} never reached"
    mean2, min2 = d["mean_win_rate_second_half"], d["min_win_rate_second_half"]
    return [Figure(
        "win rate of the default vs a random opponent",
        f"{min2:.2f} (min of the second half), {d['final_win_rate']:.2f} at the end",
        f"{d['max_win_rate']:.2f} (max); {first}", ("learning.json",),
        f"{d['budget_minutes']:.0f} min, one run, from {d['start_win_rate']:.3f}; second half {mean2:.2f} "
        f"(goal 0.95: {_met(mean2 >= 0.95)})",
        f"`bench/learning.py`: the embedded default as `make run` trains it (no overrides), {d['budget_minutes']:.0f} "
        f"minutes, one run, the win rate over the last 512 games; {d['start_win_rate']:.3f} at "
        f"the start, {mean2:.3f} averaged over the second half. Goals: 0.9 within 5 minutes "
        f"{_met(t is not None and t <= 300)}, a second-half minimum >= 0.9 {_met(min2 >= 0.9)}, a second-half mean "
        f">= 0.95 {_met(mean2 >= 0.95)}")]


def memory_model(load: Load) -> list[Figure]:
    d = load("memory_model")
    if d is None:
        return []
    out = []
    rows = d["measured"]["configs"]
    errors = [abs(c["relative_error"]) for c in rows]
    default = d["measured"]["default_malloc_check"]
    glibc = default["measured_bytes"] / default["predicted_bytes"] - 1
    out.append(Figure(
        "memory model: error of the predicted peak", f"{max(errors):.1%}", f"{min(errors):.1%}", ("memory_model.json",),
        f"{len(rows)} configurations (`MALLOC_MMAP_THRESHOLD_=65536`; glibc's default: +{glibc:.0%})",
        f"`bench/memory_model.py` (a) and (b): {len(rows)} configurations of 25M/30M-parameter models (fp32, 1 thread, "
        f"{_span([c['seq_len'] for c in rows])} tokens, eager and sdpa attention, "
        f"with and without recomputation), one step each, with `MALLOC_MMAP_THRESHOLD_=65536`; under glibc's default "
        f"the measured peak was {glibc:+.0%} against the prediction (freed blocks stay in the heap)"))
    sharded = [c for c in d["sharded"]["configs"] if c["plan"] != "dp1"]
    if sharded:
        worst = max(sharded, key=lambda c: c["max_abs_relative_error"])
        best = min(sharded, key=lambda c: c["max_abs_relative_error"])
        out.append(Figure(
            "memory model per rank, sharded plans",
            f"{worst['max_abs_relative_error']:.1%} ({worst['plan']}, {worst['attn']})",
            f"{best['max_abs_relative_error']:.1%} ({best['plan']}, {best['attn']})", ("memory_model.json",),
            f"{', '.join(sorted({c['plan'] for c in sharded}))} on gloo ranks",
            f"`bench/memory_model.py` (c): {len(sharded)} rows of {', '.join(sorted({c['plan'] for c in sharded}))} on "
            f"gloo ranks of 25-30M-parameter models, {_span([c['seq_len'] for c in sharded])} tokens, the real "
            f"`train_step`, `MALLOC_MMAP_THRESHOLD_=65536`; the error of each rank's peak, the worst rank of each row"))
    real = d.get("real_model")
    if real and real.get("configs"):
        rows = [c for c in real["configs"] if "relative_error" in c]
        under = min(rows, key=lambda c: c["relative_error"])
        over = max(rows, key=lambda c: c["relative_error"])
        tokens = [c["tokens"] for c in rows if c.get("tokens")]
        learnt = d.get("max_underprediction_with_learnt_reserve", real.get("max_underprediction_with_learnt_reserve"))
        out.append(Figure(
            "memory model, SmolLM2-135M per rank",
            f"{-under['relative_error']:.1%} under ({under['case']}); {over['relative_error']:.1%} over ({over['case']})",
            f"{learnt:.2%} under (learnt reserve)" if learnt is not None else "-", ("memory_model.json",),
            f"{len(rows)} rows, {_span(tokens)} tokens a micro-batch",
            f"`bench/memory_model.py --only-real-model`: {len(rows)} rows ({', '.join(c['case'] for c in rows)}) on "
            f"SmolLM2-135M's size (heads8: 8/4 heads, random weights, where tp2 and sp2 need heads divisible by 2), "
            f"2 gloo ranks, fp32, sdpa, `MALLOC_MMAP_THRESHOLD_=65536`, states and one step per rank. Best: each "
            f"layout's longer row against the model plus the reserve learnt from its first row "
            f"(`selector.learn_reserve`'s rule)"))
    return out


def weight_sync(load: Load) -> list[Figure]:
    d = load("weight_sync")
    if d is None:
        return []
    ratios = d["full_over_sharded_total_seconds"]
    worst, best = _ends(ratios)
    label = {k: k.replace("_", ", ") for k in ratios}
    return [Figure(
        "sharded weight publish + pull vs rank-0 copy", f"{ratios[worst]:.1f}x ({label[worst]})",
        f"{ratios[best]:.1f}x ({label[best]})", ("weight_sync.json",), f"medians of {d['repetitions']}",
        f"`bench/weight_sync.py`: {d['ranks']} gloo ranks, fsdp2 and tp2, {' and '.join(d['sizes'])} parameters, "
        f"{d['dtype']}, one host (shared memory), seconds of publish + pull, medians of {d['repetitions']}")]


def engine(load: Load) -> list[Figure]:
    d = load("engine")
    if d is None:
        return []
    rows = d["configs"]
    worst, best = min(rows, key=lambda c: c["speedup"]), max(rows, key=lambda c: c["speedup"])

    def ep(c: dict[str, Any]) -> str:
        return f"{c['episodes']} episode{'s' if c['episodes'] > 1 else ''}"

    return [Figure(
        "built-in engine vs `transformers` `generate`", f"{worst['speedup']:.1f}x ({ep(worst)})",
        f"{best['speedup']:.1f}x ({ep(best)})", ("engine.json",), f"medians of {d['reps']}",
        f"`bench/engine.py`: {d['turns']} turns of {d['new_tokens_per_turn']} new tokens, batches of "
        f"{', '.join(str(b) for b in d['batch_sizes'])} episodes, the embedded 1.1M-parameter model, {d['threads']} "
        f"thread, generated tokens/s, medians of {d['reps']}")]


def dispatch(load: Load) -> list[Figure]:
    d = load("dispatch")
    if d is None:
        return []
    lays = d["layouts"]
    out = []
    for key, name in (("speedup_vs_central", "central dispatch"), ("speedup_vs_ray", "Ray object refs")):
        have = {k: v[key] for k, v in lays.items() if v.get(key)}
        if not have:
            continue
        worst, best = _ends(have)
        out.append(Figure(
            f"layout-aware pull vs {name}", f"{have[worst]:.1f}x ({worst})", f"{have[best]:.1f}x ({best})",
            ("dispatch.json",), f"{len(have)} layouts, one host",
            f"`bench/dispatch.py`: {d['config']['producers']} producers to {d['config']['consumers']} consumers on one "
            f"host, {len(have)} layouts ({', '.join(have)}), {d['bytes_per_step'] / 2**20:,.0f} MiB a step, medians of "
            f"{d['config']['repetitions']}"))
    return out


def dispatch_cluster(load: Load) -> list[Figure]:
    d = load("dispatch_cluster")
    if d is None:
        return []
    frac = d["fraction_of_ideal"]
    small = min(f for n, by in frac.items() if int(n) <= 8 for f in by.values())
    biggest = max(frac, key=int)
    at_big = min(frac[biggest].values())
    best = d["best_fraction_of_ideal"]
    sync = d["weight_sync_max_over_min_2_to_8_hosts"]
    slow, flat = max(sync, key=sync.__getitem__), min(sync, key=sync.__getitem__)
    names = {"rank0": "from rank 0", "sharded": "sharded", "relay": "relay chain"}
    link = d["link_rate_bits_per_s"] / 1e6
    return [
        Figure("pull vs central across hosts: fraction of the link-bound ideal",
               f"{at_big:.2f} ({biggest} hosts), {small:.2f} (2-8)",
               f"{best['fraction']:.2f} ({best['hosts']} hosts, {best['layout']})", ("dispatch_cluster.json",),
               "namespaces as hosts",
               f"`bench/dispatch_cluster.py`: {', '.join(sorted(frac, key=int))} network namespaces as hosts, tc tbf "
               f"links of {link:.0f} Mbit/s standing in for 100 Gbit/s NICs (payloads scaled by "
               f"1/{max(d['payload_scale'], 1 / d['payload_scale']):.0f}), layouts dp, dp x tp, dp x sp; goal 0.8 "
               f"{_met(bool(d['goal_met_fraction_of_ideal']))}"),
        Figure("weight sync 2 -> 8 rollout hosts, slowest / fastest", f"{sync[slow]:.2f}x ({names.get(slow, slow)})",
               f"{sync[flat]:.2f}x ({names.get(flat, flat)})", ("dispatch_cluster.json",),
               f"goal 1.5x {_met(sync[flat] <= 1.5)}",
               "the same run: a version's seconds at 8 rollout hosts over those at 2, from 2 trainer hosts, each "
               "way of sending it (from rank 0, each rank its shard, a relay chain)")]


def openai_endpoint(load: Load) -> list[Figure]:
    d = load("openai_endpoint")
    if d is None:
        return []
    ratios = {(m, e): r["endpoint_over_builtin_tokens_per_s"] for m, by in d["models"].items() for e, r in by.items()
              if r.get("endpoint_over_builtin_tokens_per_s") is not None}
    worst, best = _ends(ratios)
    names = {"default": "the 1.1M default", "random": "a random tiny model", "smollm2": "SmolLM2"}
    cases = ", ".join(f"{names.get(m, m)} on {e} {r:.2f}" for (m, e), r in sorted(ratios.items()))
    return [Figure(
        "OpenAI endpoint vs built-in agent loop, tokens/s", f"{ratios[worst]:.2f} ({names.get(worst[0])}, {worst[1]})",
        f"{ratios[best]:.2f} ({names.get(best[0])}, {best[1]})", ("openai_endpoint.json",),
        f"{len(ratios)} model and game pairs",
        f"`bench/openai_endpoint.py`: the same episodes played by `agent_loop` and by an agent process through the "
        f"real `openai` client over HTTP, one engine, 1 thread, the modes alternating (medians): {cases}. Short turns "
        f"(Tic-Tac-Toe: ~2 tokens) pay a request's fixed cost (~5 ms) on every turn; the goal (cost <= 20%) holds "
        f"where ratios are >= 0.8")]


def oom_recovery(load: Load) -> list[Figure]:
    d = load("oom_recovery")
    if d is None:
        return []
    times = [t for t in d["recovery_in_step_times"] if t is not None]
    crashed = f"{d['crashes']} of {d['repeats']} runs crashed" if d["crashes"] else ""
    worst = "; ".join(x for x in (crashed, f"{max(times):.2f} step times" if times else "") if x) or "-"
    return [Figure(
        "per OOM recovery, memory model 2x low", worst, f"{min(times):.2f} step times" if times else "-",
        ("oom_recovery.json",), f"SmolLM2, 2 ranks, {d['repeats']} runs, {d['lost']} lost",
        f"`bench/oom_recovery.py`: `{d['settings']['config']}`, {d['settings']['ranks']} trainer ranks each under "
        f"{d['settings']['cap']}, the memory model scaled by {d['settings']['memory_model_scale']} (wrong on purpose), "
        f"{d['settings']['steps']} steps, {d['repeats']} runs: {d['recoveries']} recoveries, {d['crashes']} crashes, "
        f"{d['lost']} samples lost"
        + (f"; seconds lost per recovery {_iv(d['seconds_lost_per_recovery_ci95'], 0, ' s')}"
           if d.get("seconds_lost_per_recovery_ci95") else ""))]


def sandbox(load: Load) -> list[Figure]:
    d = load("sandbox")
    if d is None:
        return []
    arms = {"environment from a file": d["bwrap_vs_none"], "agent programs": d["agent_bwrap_vs_none"]}
    worst, best = _ends(arms, lambda a: a["ratio"])
    return [Figure(
        "sandboxed (bwrap) vs plain, episodes/s", f"{_ratio(arms[worst])} ({worst})", f"{_ratio(arms[best])} ({best})",
        ("sandbox.json",), f"{d['reps']} rounds per mode",
        f"`bench/sandbox.py`: {d['episodes']} {d['env']} episodes a round, modes {', '.join(d['modes'])} in rotated "
        f"order, {d['reps']} rounds each; process vs none {_ratio(d['process_vs_none'])}; goal: {d['goal']} "
        f"({_met(bool(d['goal_met']))})")]


def selector(load: Load) -> list[Figure]:
    d = load("selector")
    if d is None:
        return []
    per = d["adaptive_vs_oracle_per_phase"]
    crashes, plans = d["static_crashes"], len(d["static_plans"])
    return [Figure(
        "adaptive selector vs best static plan per phase", f"{min(per):.2f}", f"{max(per):.2f}", ("selector.json",),
        f"{crashes} of the {plans} static plans OOM",
        f"`bench/selector.py`: {d['world']} gloo ranks, each under a real memory cap, contexts growing through "
        f"{', '.join(f'{n:,}' for n in d['phase_max_len'])} tokens, {_steps(d['steps_per_phase'])} steps a phase; "
        f"throughput "
        f"per phase against the best static plan that survived it; plans used: {', '.join(d['plans_used'])}; "
        f"{crashes} of the {plans} static plans ran out of memory, the selector "
        f"{'did too' if d['adaptive_crashed'] else 'did not'}")]


def context_growth(load: Load) -> list[Figure]:
    d = load("context_growth")
    if d is None:
        return []
    s = d["settings"]
    arms = {f"static, cut at {s['limit']} tokens": d.get("static"), "adaptive": d.get("adaptive"),
            "static without the limit": d.get("static_unbounded")}
    arms = {k: v for k, v in arms.items() if v}

    def one(name: str) -> str:
        arm = arms[name]
        return (f"{name} {arm['final_success']:.2f}" + (f" ({arm['truncated_fraction']:.0%} cut off)"
                                                        if arm.get("truncated_fraction") else "")
                + (" (crashed)" if arm.get("crashed") else ""))

    order = sorted(arms, key=lambda k: arms[k]["final_success"])
    return [Figure(
        "contexts outgrow a static limit (EARL Fig. 1), final success", one(order[0]),
        "; ".join(one(k) for k in reversed(order[1:])), ("context_growth.json",), f"{s['minutes']:.0f} min a run",
        f"`bench/context_growth.py`: Tic-Tac-Toe matches growing from {s['games']} to {s['max_games']} games, 2 "
        f"trainer ranks each capped by a memory cgroup ({s['cap_mib']} MiB above its size, {s['reserve_mib']} of it "
        f"the selector's reserve), {s['minutes']:.0f} minutes a run, one run per arm; success over the last games. "
        "Steps: " + ", ".join(f"{k} {v['steps']}" for k, v in arms.items() if "steps" in v)
        + f"; the static plan is {', '.join(d['static_plans_used'])}; the selector went {' -> '.join(d['plans_used'])}; "
        "peak MiB above the start: " + ", ".join(f"{k} {v['peak_mib_above_start']}" for k, v in arms.items()
                                                  if isinstance(v.get("peak_mib_above_start"), (int, float))))]


def cpu_of(d: dict[str, Any]) -> str:
    """The CPU a result file names in its provenance ('' if none)."""
    return ((d.get("provenance") or {}).get("machine") or {}).get("cpu", "")


def cpus_of(d: dict[str, Any]) -> dict[str, str]:
    """The CPU of each part a result file holds, where recorded: "" the run that wrote it, then each part it kept from
    an earlier run (`part_provenance`), which may have run on another machine."""
    kept = {part: ((prov or {}).get("machine") or {}).get("cpu", "") for part, prov in (d.get("part_provenance") or {}).items()}
    return {part: cpu for part, cpu in {"": cpu_of(d), **kept}.items() if cpu}


def short_cpu(cpu: str) -> str:
    """A CPU model as the pages name it ('Intel(R) Xeon(R) Processor' -> 'Intel Xeon')."""
    return cpu.replace("(R)", "").replace(" Processor", "")


def _calibrated_elsewhere(load: Load, d: dict[str, Any]) -> str:
    """Where a run's starting cost model (a result file) was calibrated on another CPU than the run's, say so: its
    seconds per token then describe that CPU, not the one the plans ran on."""
    model = Path((d.get("settings") or {}).get("cost_model") or "").stem
    calibration = load(model) if model else None
    if calibration is None or not cpu_of(d) or cpu_of(calibration) in ("", cpu_of(d)):
        return ""
    return f" (on {cpu_of(d)}, from a cost model calibrated on {cpu_of(calibration)})"


def real_scale(load: Load) -> list[Figure]:
    runs = [(name, d) for name in ("real_scale", "real_scale_heads8") if (d := load(name)) is not None]
    if not runs:
        return []
    e2e = {name: d["vs_best_static_end_to_end"] for name, d in runs}
    label = {"real_scale": "SmolLM2", "real_scale_heads8": "8 heads"}

    def one(name: str) -> str:
        x = e2e[name]
        iv = f"[{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}]" if "ci95" in x else "(no interval: 1 run of the static plan)"
        return f"{x['ratio']:.2f}x end to end {iv} ({label[name]}, vs {x['best_static']})"

    worst, best = _ends(e2e, lambda x: x["ratio"])
    details = []
    for name, d in runs:
        x = e2e[name]
        details.append(
            f"{label[name]} (`{name}.json`): adaptive {_iv(x['adaptive_seconds'], 1, ' s')} against static "
            f"{x['best_static']} {_iv(x['best_static_seconds'], 1, ' s')}, {x['adaptive_seconds']['n']} repeats each, "
            f"interleaved; the selector's plans by phase: {', '.join(d['plans_used'])}{_calibrated_elsewhere(load, d)}")
    first = runs[0][1]
    st = first["settings"]
    growth = first["runs"]["adaptive"]["phases"] if "adaptive" in first.get("runs", {}) else []
    tokens = (f"{growth[0]['p99_episode_tokens']} -> {growth[-1]['p99_episode_tokens']:,} tokens" if growth
              else "growing contexts")
    return [Figure(
        "selector at long context vs the best static plan that fits", one(worst), one(best),
        tuple(f"{n}.json" for n, _ in runs), tokens,
        f"`bench/real_scale.py`: SmolLM2-135M's size, {st['nproc']} trainer ranks each in a {st['cap_gib']} GiB memory "
        f"cgroup, `long_recall` episodes {tokens} over {st['levels']} phases of {st['steps_per_phase']} steps; each "
        "static plan at the token cap its probes found (or was given). "
        + "; ".join(details))]


def lora(load: Load) -> list[Figure]:
    d = load("lora")
    if d is None:
        return []
    trl = d["trl_lora"].get("gain")
    gain = d["gain_ratio"]
    return [
        Figure("LoRA (rank 1) vs full weights, SmolLM2-135M", f"sync {d['sync_seconds_ratio']:.0f}x faster",
               f"version {d['sync_bytes_ratio']:.0f}x smaller", ("lora.json",), "publish + pull + apply",
               "`bench/lora.py`: one version's publish + pull + apply, full weights against an unmerged rank-1 "
               "adapter, medians over versions"),
        Figure(f"held-out gain, {d['steps_per_run']} steps x {d['seeds']} seeds, {d['problems']} problems",
               f"LoRA {_iv(d['lora']['gain'], 3, sign='+')} ({gain['mean']:.2f}x the full gain [{gain['low']:.2f}, "
               f"{gain['high']:.2f}])",
               f"full {_iv(d['full']['gain'], 3, sign='+')}" + (f"; TRL + peft {trl['mean']:+.3f} ({trl['n']} seed)" if trl else ""),
               ("lora.json",), f"from {d['heldout_before']['success']:.2f}",
               f"`bench/lora.py`: SmolLM2-135M-Instruct on three-term addition, rank-1 LoRA (lr 2e-4) against full "
               f"weights (lr 2e-5), {d['steps_per_run']} steps a run, {d['seeds']} seeds per arm interleaved, "
               f"held-out success on {d['problems']} problems (greedy) before and after")]


def e2e(load: Load) -> list[Figure]:
    d = load("e2e")
    if d is None:
        return []
    out = []
    if d.get("async_vs_ceiling"):
        rates = d["samples_per_s"] if isinstance(d.get("samples_per_s"), dict) else {}
        out.append(Figure(
            "asynchronous vs its ceiling / vs synchronous", f"{_iv(d['async_vs_ceiling'])} of its ceiling (goal 0.95)",
            f"{_iv(d['async_vs_sync'], unit='x')} samples/s", ("e2e.json",), f"{d['repeats']} repeats per arm",
            f"`bench/e2e.py --part comparison`: the embedded default on Tic-Tac-Toe, {d['seconds_per_run']:.0f} s a run "
            f"after its first step, {d['repeats']} repeats per arm interleaved. Async: rollout pinned to CPU 0, "
            f"trainer to CPU 1, `max_staleness` 1; its ceiling is what its own pools' CPU seconds per step allow. "
            f"Sync: `max_staleness` 0, every core to each phase"
            + (f"; samples/s async {_iv(rates['async'], 1)}, sync {_iv(rates['sync'], 1)}"
               if "async" in rates and "sync" in rates else ""), part="comparison"))
        loss = d.get("loss_tokens_per_s") or {}
        target = (d.get("time_to_target_vs_trl") or {}).get("default_model") or {}
        faster = (f"to {d['target_win_rate']} in <= {target['at_most']:.2f}x the time (TRL never)"
                  if target.get("at_most") is not None else "")
        trl_loss = (loss["async"]["mean"] / loss["trl"]["mean"]) if "trl" in loss and "async" in loss else None
        out.append(Figure(
            "asynchronous vs TRL `GRPOTrainer`", f"{_iv(d['async_vs_trl'], unit='x')} samples/s",
            "; ".join(x for x in ((f"{trl_loss:.2f}x loss tokens/s" if trl_loss else ""), faster) if x),
            ("e2e.json",), "TRL trains a game's first move",
            "the same run: TRL 1.16 `GRPOTrainer` in fp32 with the same estimator, group size, groups a step and lr, "
            "no KL, at the thread count its probe found faster. TRL is single-turn: its sample is the game's first "
            "move; earl_stream trains every move", part="comparison"))
    ab = d.get("staleness_ablation")
    if ab:
        mean = {k: v.get("seconds_to_target_mean") or {} for k, v in ab.items()}
        missed = {k: sum(t is None for t in v["seconds_to_target"]) for k, v in ab.items()}
        reached = {k: m for k, m in mean.items() if m.get("mean") is not None and not missed[k]}
        order = sorted(reached, key=lambda k: reached[k]["mean"])
        worst = [f"{k}: missed in {missed[k]} of {len(ab[k]['seconds_to_target'])}" for k in ab if missed[k]]
        worst += [f"{order[-1]}: {_iv(reached[order[-1]], 0, ' s')}"] if order else []
        out.append(Figure(
            "`trainer.max_staleness` " + ", ".join(ab) + ": time to a 0.9 win rate", "; ".join(worst),
            "; ".join(f"{k}: {_iv(reached[k], 0, ' s')}" for k in order[:min(2, max(1, len(order) - 1))]),
            ("e2e.json",),  # the best two, leaving the slowest to the worst column where there are three or fewer
            f"{len(next(iter(ab.values()))['seconds_to_target'])} seeds of {d['ablation_seconds']:.0f} s",
            f"`bench/e2e.py --part staleness`: the comparison's asynchronous setting, {d['ablation_seconds']:.0f} s "
            f"after the first step, seeds interleaved; seconds from launch to a 0.9 win rate (last 256 games) per "
            f"seed: " + "; ".join(f"{k}: {', '.join('never' if t is None else f'{t:.0f}' for t in v['seconds_to_target'])}"
                                  for k, v in ab.items()), part="staleness"))
    s = d.get("smollm2")
    if s and s.get("heldout_at_budget"):
        held, loss = s["heldout_at_budget"], s["loss_tokens_per_s"]
        target = s.get("time_to_target_vs_trl") or {}
        gain, minutes = f"+{s['target_gain'] * 100:.0f} points", f"{s['budget_s'] / 60:.0f}"
        when = (f"{gain} in <= {target['at_most']:.2f}x TRL's time" if target.get("at_most") is not None
                else f"{gain} in {target['mean']:.2f}x TRL's time" if target.get("mean") is not None else "")
        out.append(Figure(
            f"SmolLM2-135M vs TRL `GRPOTrainer` (every weight), held-out at {minutes} min",
            f"{loss['earl_stream']['mean'] / loss['trl']['mean']:.2f}x TRL's loss tokens/s",
            f"held-out {_iv(held['earl_stream'])} vs {_iv(held['trl'])}" + (f"; {when}" if when else ""),
            ("e2e.json",), f"{held['earl_stream']['n']} seeds a system",
            "`bench/e2e.py --part smollm2`: `configs/smollm2_arithmetic.yaml` as shipped against TRL 1.16 "
            f"`GRPOTrainer` training every weight with the same model, task, scorer, lr, groups and sampling, {minutes} "
            f"minutes a run from launch, seeds interleaved; checkpoints scored afterwards on {s['problems']} held-out "
            "problems "
            f"(greedy); loss tokens/s earl_stream {_iv(loss['earl_stream'], 1)}, TRL {_iv(loss['trl'], 1)} "
            "(dynamic sampling trains only groups whose rewards differ)", part="smollm2"))
    return out


FIGURES = (learning, memory_model, weight_sync, engine, dispatch, dispatch_cluster, openai_endpoint, oom_recovery,
           sandbox, selector, context_growth, real_scale, lora, e2e)


def all_figures(load: Load) -> list[Figure]:
    return [f for make in FIGURES for f in make(load)]
