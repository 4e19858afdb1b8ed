"""The tables of docs/BENCHMARKS.md: one renderer per benchmark (a results dict in, Markdown lines out), and
the formatting they share. `bench/report.py` holds which benchmark uses which, and writes the page."""

from __future__ import annotations

from typing import Any

from bench.stats import mean_ci95


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:,.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
        return ", ".join(fmt(x, digits) for x in v)
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return out + [""]


def _scalars(d: dict[str, Any], prefix: str = "", depth: int = 2) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) and depth > 1:
            rows += _scalars(v, f"{prefix}{k}.", depth - 1)
        elif isinstance(v, (int, float, str, bool)) or v is None or (
                isinstance(v, list) and len(v) <= 4 and all(isinstance(x, (int, float)) for x in v)):
            if isinstance(v, str) and len(v) > 120:
                continue
            rows.append([f"`{prefix}{k}`", v])
    return rows


# ------------------------------------------------------------------------------------ renderers

def _said(d: dict[str, Any]) -> list[str]:
    """A result file's own words (its `finding`, `note` and `notes`: a sentence or a list of them), one paragraph each."""
    said = {k: " ".join(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else v
            for k in ("finding", "note", "notes") if (v := d.get(k))}
    return [line for k, v in said.items() if isinstance(v, str) for line in (f"**{k.capitalize()}:** {v}", "")]


def render_generic(d: dict[str, Any]) -> list[str]:
    rows = _scalars(d)
    return (_table(["result", "value"], rows[:60]) if rows else ["(no scalar results)", ""]) + _said(d)


def _mib(v: Any) -> float | None:
    return v / 2**20 if isinstance(v, (int, float)) else None


def render_lora(d: dict[str, Any]) -> list[str]:
    """bench/lora.py: per arm the sync and peak figures, the held-out gain of each seed and their mean [95%
    interval], then the ratios against their goals."""
    if "runs" not in (d.get("lora") or {}):  # a result of the earlier, single-run format
        return render_generic(d)

    def gain(g: Any) -> str:
        if not isinstance(g, dict):
            return "—"
        return (f"{fmt(g['mean'])} [{fmt(g['low'])}, {fmt(g['high'])}]" if "low" in g
                else f"{fmt(g['mean'])} ± {fmt(g.get('stderr'))}")

    rows = [[k, ", ".join(fmt(g) for g in r.get("gains", [])), gain(r.get("gain")),
             ", ".join(fmt(x.get("minutes")) for x in r.get("runs", [])), _mib(r.get("peak_bytes_measured")),
             _mib(r.get("peak_bytes_predicted")), _mib(r.get("sync_bytes_per_version")), r.get("sync_seconds_per_version")]
            for k in ("full", "lora", "trl_lora") if isinstance(r := d.get(k), dict)]
    out = _table(["arm", "held-out gain per seed", "mean gain [95%]", "minutes per run", "peak MiB measured",
                  "peak MiB predicted", "sync MiB/version", "sync s/version"], rows)
    ratio, spec = d.get("gain_ratio") or {}, d.get("lora_spec") or {}
    out += [f"Held-out success before training {fmt((d.get('heldout_before') or {}).get('success'))} "
            f"(± {fmt((d.get('heldout_before') or {}).get('stderr'))}, {fmt(d.get('problems'))} problems); "
            f"{fmt(d.get('steps_per_run'))} steps a run, LoRA rank {spec.get('rank')}, alpha {spec.get('alpha')}. "
            f"Full over LoRA: sync bytes **{fmt(d.get('sync_bytes_ratio'))}x** (goal >= 50), sync seconds "
            f"**{fmt(d.get('sync_seconds_ratio'))}x** (goal >= 10); LoRA's mean held-out gain over the full "
            f"fine-tune's: **{fmt(ratio.get('mean'))}** [95% {fmt(ratio.get('low'))}, {fmt(ratio.get('high'))}] "
            "(goal >= 0.8).", ""]
    return out + _said(d)


def render_distill(d: dict[str, Any]) -> list[str]:
    """bench/distill.py: steps and seconds to the target per arm and seed, the final win rates, then the best
    distillation arm's steps over GRPO's (mean of the per-seed ratios, 95% interval)."""
    steps, secs, final = d.get("steps_to_target", {}), d.get("seconds_to_target", {}), d.get("final_win_rate", {})
    rows = [[arm, ", ".join(fmt(v) for v in steps.get(arm, [])), ", ".join(fmt(v) for v in secs.get(arm, [])),
             ", ".join(fmt(v) for v in final.get(arm, []))] for arm in steps]
    out = _table(["arm", "steps to target (per seed)", "seconds to target", "final win rate"], rows)
    best = d.get("best_distill_vs_grpo_steps") or {}
    out += [f"Teacher win rate {fmt(d.get('teacher_win_rate'))} (student {fmt((d.get('student_eval') or {}).get('win_rate'))}), "
            f"target {fmt(d.get('target_win_rate'))}, {fmt(d.get('minutes_per_run'))} minutes a run. Best distillation "
            f"arm `{best.get('arm')}`: **{fmt(best.get('mean'))}x** GRPO's steps [{fmt(best.get('low'))}, "
            f"{fmt(best.get('high'))}] over {best.get('n')} paired seeds (goal <= 0.5).", ""]
    second = d.get("at_second_target") or {}
    if second:
        b2, steps2 = second.get("best_distill_vs_grpo_steps") or {}, second.get("steps_to_target", {})
        out += [f"At a {fmt(second.get('target_win_rate'))} win rate: steps per seed "
                + "; ".join(f"{arm} {', '.join(fmt(v) for v in vals)}" for arm, vals in steps2.items())
                + f". Best distillation arm `{b2.get('arm')}`: **{fmt(b2.get('mean'))}x** GRPO's steps "
                f"[{fmt(b2.get('low'))}, {fmt(b2.get('high'))}] over {b2.get('n')} paired seeds.", ""]
    return out + _said(d)


def render_real_scale(d: dict[str, Any]) -> list[str]:
    """bench/real_scale.py: per strategy its repeats, crashes, end-to-end seconds (mean [95% interval]) and per
    phase its plan and trained tokens/s; then adaptive against the best crash-free static plan end to end and the
    fastest surviving static plan per phase (`same_plan` phases count neither way), rewards and held-out success."""
    if "per_phase" not in d:  # a result of the earlier, single-repeat format
        return render_generic(d)

    def ci(x: Any) -> str:
        if not isinstance(x, dict) or not x.get("n"):
            return "—"
        return f"{fmt(x.get('mean'))} [{fmt(x.get('low'))}, {fmt(x.get('high'))}]" if "low" in x else fmt(x.get("mean"))

    runs, e2e, caps = d.get("runs", {}), d.get("end_to_end_seconds", {}), d.get("token_caps", {})
    rows = []
    for kind, phases in d["per_phase"].items():
        first = runs.get(kind, {})
        seconds = e2e.get(kind) or []
        took = ci(mean_ci95(seconds)) if len(seconds) >= 2 else fmt(seconds[0]) if seconds else "—"
        crash = f"phase {first.get('crash_phase')}" if first.get("crashed") else "no" if first.get("started") else "did not start"
        cap = (caps.get(kind.split(":", 1)[1]) or {}).get("tokens") if kind.startswith("static:") else None
        rows.append([kind, d.get("repeats", {}).get(kind), crash, cap, took,
                     *(f"{p['plan'] or '—'}: {ci(p['tokens_per_s'])}" for p in phases)])
    levels = max((len(v) for v in d["per_phase"].values()), default=0)
    out = _table(["strategy", "repeats", "crash", "token cap", "end-to-end s", *(f"phase {k}: plan, tokens/s"
                                                                               for k in range(levels))], rows)
    versus = d.get("vs_best_static_end_to_end") or {}
    if versus:
        low, high = (versus.get("ci95") or [None, None])
        out += [f"End to end, the best crash-free static plan (`{versus.get('best_static')}`) over adaptive: "
                f"**{fmt(versus.get('ratio'))}x** [95% {fmt(low)}, {fmt(high)}] (> 1: adaptive faster; goal >= 1.10).", ""]
    oracle = d.get("static_oracle") or {}
    if oracle:
        ratio = oracle.get("vs_best_static")
        out += [f"The ceiling of any choice among these static plans (each phase trained by the one fastest in it, "
                f"{' / '.join(oracle.get('phase_plans') or [])}, switches free): {fmt(oracle.get('step_seconds'))} s of "
                f"steps against the best static plan's {fmt(oracle.get('best_static_step_seconds'))} s, "
                f"**{'—' if ratio is None else f'{ratio:.2f}'}x**.", ""]
    if d.get("vs_best_static_with_tuning") is not None:
        spent = (d.get("tuning_seconds") or {}).get(versus.get("best_static"))
        out += [f"Finding that plan's token cap took {fmt(spent)} s of probes (some OOM-killed), which the adaptive "
                f"arm did not need; counted in, the best static plan over adaptive is "
                f"**{fmt(d.get('vs_best_static_with_tuning'))}x**.", ""]
    phase_rows = [[p["phase"], p.get("adaptive_plan"), p.get("fastest_static"), p.get("static_plan"), p.get("ratio"),
                   "same plan" if p.get("same_plan") else ""] for p in d.get("phase_vs_fastest_static", [])]
    if phase_rows:
        out += _table(["phase", "adaptive plan", "fastest static", "its plan", "adaptive / it (tokens/s)", ""], phase_rows)
    rewards = d.get("reward_per_phase", {}).get("adaptive")
    out += [f"Phase lengths (tokens per episode): {d.get('phase_episode_tokens')}. Adaptive's mean reward per phase: "
            f"{rewards}. Held-out success before {fmt((d.get('heldout_before') or {}).get('success'))} "
            f"(± {fmt((d.get('heldout_before') or {}).get('stderr'))}), after the adaptive run "
            f"{fmt((d.get('heldout_after') or {}).get('success'))} (± {fmt((d.get('heldout_after') or {}).get('stderr'))}).",
            ""]
    return out + _said(d)


def render_lora_sync(d: dict[str, Any]) -> list[str]:
    """bench/lora_sync.py: bytes and seconds (mean [95% interval]) of one version per arm, then full over LoRA."""
    def ci(x: Any) -> str:
        return f"{fmt(x.get('mean'))} [{fmt(x.get('low'))}, {fmt(x.get('high'))}]" if isinstance(x, dict) else "—"

    rows = [[arm, _mib(r.get("bytes_per_version")), ci(r.get("total_s")), ci(r.get("publish_s")), ci(r.get("pull_s")),
             ci(r.get("apply_s")), len(r.get("repeats", []))] for arm, r in d.get("arms", {}).items()]
    out = _table(["arm", "MiB/version", "sync s", "publish s", "pull s", "apply s", "repeats"], rows)
    for rank, b in d.get("sync_bytes_ratio", {}).items():
        s = d.get("sync_seconds_ratio", {}).get(rank, {})
        med = d.get("sync_seconds_ratio_of_medians", {}).get(rank)
        out += [f"Full over LoRA {rank}: bytes **{fmt(b)}x** (goal >= 50), seconds **{fmt(s.get('ratio'))}x** "
                f"[95% {fmt(s.get('low'))}, {fmt(s.get('high'))}] (goal >= 10; of the medians {fmt(med)}x).", ""]
    return out + _said(d)


def render_moe(d: dict[str, Any]) -> list[str]:
    """bench/moe.py: routing replay at equal weights and in learning runs (mean [95% interval], n per arm), then
    the plans' tokens/s and the selector's choice."""
    def ci(x: Any) -> str:
        return (f"{fmt(x.get('mean'))} [{fmt(x.get('low'))}, {fmt(x.get('high'))}], n={fmt(x.get('n'))}"
                if isinstance(x, dict) else "—")

    arms = ("replay", "no_replay")
    learning = d.get("learning", {})
    rows = [[arm, ci(d.get("routing_mismatch_equal_weights", {}).get(arm)),
             ci(d.get("logprob_kl_equal_weights", {}).get(arm)), ci(d.get("logprob_abs_diff_equal_weights", {}).get(arm)),
             ci(learning.get(arm, {}).get("final_reward")),
             f"{fmt(learning.get(arm, {}).get('collapses'))} of {fmt(learning.get(arm, {}).get('runs'))}"] for arm in arms]
    out = _table(["arm", "routing decisions differing (equal weights)", "KL engine||trainer, nats/token (k3)",
                  "mean abs log-prob diff", "learning: final reward", "collapses"], rows)
    r = d.get("kl_ratio_replay_over_no_replay", {})
    runs = d.get("learning_runs", {})
    out += [f"KL with replay over without, at equal weights: **{fmt(r.get('ratio'))}x** [95% {fmt(r.get('low'))}, "
            f"{fmt(r.get('high'))}] (goal <= 0.5: {fmt(d.get('goal_met'))}). Learning runs: "
            f"{fmt(runs.get('minutes_per_run'))} minutes each, max_staleness {fmt(runs.get('max_staleness'))}, "
            f"{fmt(runs.get('dtype'))}.", ""]
    out += [f"- {k}: {v}" for k, v in d.get("definitions", {}).items()] + [""]
    t = d.get("throughput", {})
    by = t.get("measured_by") or {}
    origin = (f" (kept from the run of {str(by.get('when'))[:10]} at `{str(by.get('commit'))[:7]}`, on a "
              f"{fmt((t.get('model') or {}).get('num_layers'))}-layer MoE)" if by else "")
    for n, plans in d.get("plans_tokens_per_s", {}).items():
        choice = d.get("selector_choice", {}).get(n, {})
        out += [f"Tokens/s at {n} tokens per sequence{origin}: " + ", ".join(f"{p} {fmt(v)}" for p, v in plans.items())
                + f"; the selector chose {fmt(choice.get('plan'))} (faster measured: {fmt(choice.get('faster_measured'))}).",
                ""]
    return out + _said(d)


def render_dispatch(d: dict[str, Any]) -> list[str]:
    rows = []
    for name, r in d.get("layouts", {}).items():
        rows.append([name, r.get("bytes_delivered", 0) / 2**20, r.get("pull_seconds"), r.get("pull_zero_copy_seconds"),
                     r.get("pull_tcp_seconds"), r.get("central_seconds"), r.get("ray_seconds"),
                     r.get("speedup_vs_central"), r.get("speedup_vs_ray")])
    out = _table(["layout", "MiB/step", "pull s", "pull zero-copy s", "pull TCP s", "central s", "Ray s",
                  "x vs central", "x vs Ray"], rows)
    c = d.get("ceilings", {})
    out.append(f"Same-host ceilings: memcpy {fmt(c.get('memcpy_gibps'))} GiB/s, shared memory (copy in + copy "
               f"out) {fmt(c.get('shm_gibps'))} GiB/s. Medians over {fmt(d.get('config', {}).get('repetitions'))} "
               "repetitions.")
    return out + [""]


def render_dispatch_cluster(d: dict[str, Any]) -> list[str]:
    """Per N and layout: pull vs central over rate-limited links, the link-bound ideal; then weight sync."""
    rows = []
    for n, e in d.get("experience", {}).items():
        for lay, x in e.get("layouts", {}).items():
            rows.append([n, lay, x.get("pull_seconds"), x.get("central_seconds"), x.get("speedup_vs_central"),
                         x.get("ideal_speedup"), d.get("fraction_of_ideal", {}).get(n, {}).get(lay),
                         x.get("pull_fraction_of_link_bound"), x.get("link_utilisation", {}).get("pull", {}).get("busiest"),
                         x.get("link_utilisation", {}).get("central", {}).get("hosts", {}).get("controller", {}).get("rx")])
    out = [f"{d.get('scaling', '')}. Netem delay applied: {d.get('config', {}).get('delay_applied')}.", ""]
    out += _table(["hosts", "layout", "pull s", "central s", "speedup", "ideal", "of ideal", "pull of its link bound",
                   "busiest link (pull)", "controller rx (central)"], rows)
    w, b = d.get("worst_fraction_of_ideal", {}), d.get("best_fraction_of_ideal", {})
    out += [f"Fraction of the link-bound ideal: worst **{fmt(w.get('fraction'))}** (N={w.get('hosts')}, {w.get('layout')}), "
            f"best {fmt(b.get('fraction'))} (N={b.get('hosts')}, {b.get('layout')}); goal >= {d.get('goal_fraction_of_ideal')}.", ""]
    losses = {n: e["tcp_losses"] for n, e in d.get("experience", {}).items() if "tcp_losses" in e}
    if losses:
        out += ["TCP losses over each N's steps (drops at a full link queue of "
                f"{d.get('config', {}).get('queue_ms')} ms): "
                + "; ".join(f"N={n}: {v['retransmitted_segments']:,} segments retransmitted, "
                            f"{v['retransmission_timeouts']} timeouts" for n, v in losses.items()) + ".", ""]
    sync = d.get("weight_sync_seconds", {})
    hosts = [str(h) for h in d.get("hosts", [])]
    out += _table(["weight sync s", *[f"{h} hosts" for h in hosts]], [[m, *(v.get(h) for h in hosts)] for m, v in sync.items()])
    flat = ", ".join(f"{m} {fmt(v)}x" for m, v in d.get("weight_sync_max_over_min_2_to_8_hosts", {}).items())
    out += [f"Weight sync, slowest / fastest over 2-8 rollout hosts: {flat} (goal <= {d.get('goal_weight_sync_flat')}x). "
            f"Medians over {fmt(d.get('config', {}).get('repetitions'))} repetitions.", ""]
    cfg = d.get("config", {})
    out += ["- *ideal*: the central controller's link-bound seconds (it gathers every row whole, then scatters each "
            "rank's part: step + delivered bytes through its one link) over the pull's (the bytes of its busiest link); "
            "a controller that overlapped gathering and scattering would be bound by the larger of the two, giving "
            "N/2 for dp (`ideal_speedup_pipelined_controller` in the JSON). *pull of its link bound*: the "
            "pull's own efficiency, independent of how slow central is.",
            "- Weights: `rank0` every rollout host pulls rank 0's full copy; `sharded` each trainer rank's own "
            f"half ({cfg.get('trainer_hosts_for_weights')} trainer hosts); `relay` a chain "
            f"(`store/relay.py`, {cfg.get('relay_chunk_kib')} KiB chunks): each host pulls from the previous one while "
            "that one is still pulling (over two connections, a chunk a request), the first from the trainer ranks.",
            f"- Every simulated host's processes share this machine's {cfg.get('cpus')} cores (load average at the "
            f"end {fmt(cfg.get('load_average_at_end'), 2)}, the benchmark's own processes included): where the links "
            "are idle and a step is "
            "still slow, round trips waiting for a core are the cause, and that grows with N and with requests per "
            "byte (dp x sp pulls two token ranges per row; the relay one request per chunk)."
            + ("" if cfg.get("delay_applied") else " This kernel has no netem: the links are rate-limited without "
               "the extra delay."), ""]
    return out + _said(d)


def render_memory_model(d: dict[str, Any]) -> list[str]:
    out: list[str] = []
    llama = d.get("llama70b", {})
    k = llama.get("korthikanti", {})
    if k:
        rows = [[name, *v.get("all_80_layers_gib", []), v.get("ratio_8192_over_4096")] for name, v in k.items()]
        out.append(f"(a) {llama.get('model', 'Llama-3.1-70B')}, activations of all layers (GiB) at "
                   f"{fmt(llama.get('seq_lens'))} tokens; the paper reports {fmt(llama.get('paper_gb'))} GB:")
        out.append("")
        out += _table(["attention", "GiB @4096", "GiB @8192", "ratio"], rows)
    m = d.get("measured", {})
    rows = [[c["model"], c["attn"], c["loss"], c["seq_len"], c["micro_batch"], c["ckpt"], c["predicted_bytes"] / 2**20,
             c["measured_bytes"] / 2**20, f"{100 * c['relative_error']:+.1f}%"] for c in m.get("configs", [])]
    if rows:
        out.append("(b) predicted vs measured peak training memory on this machine (MiB):")
        out.append("")
        out += _table(["model", "attention", "loss", "seq", "micro-batch", "recompute", "predicted", "measured",
                       "error"], rows)
    out.append(f"Largest relative error: **{fmt(100 * (d.get('max_relative_error') or 0), 2)}%**.")
    out.append("")
    sh = d.get("sharded", {})
    rows = [[c["plan"], c["model"], c["attn"], c["seq_len"], c["rows"], c["predicted_bytes"] / 2**20,
             ", ".join(f"{r['measured_bytes'] / 2**20:.1f}" for r in c["ranks"]),
             ", ".join(f"{100 * r['relative_error']:+.1f}%" for r in c["ranks"])] for c in sh.get("configs", [])]
    if rows:
        out.append("(c) per rank under sharded plans (gloo ranks, real `train_step`), predicted vs measured (MiB):")
        out.append("")
        out += _table(["plan", "model", "attention", "seq", "rows/rank", "predicted", "measured per rank",
                       "error per rank"], rows)
        out.append(f"Largest relative error over the sharded plans: "
                   f"**{fmt(100 * (d.get('max_relative_error_sharded') or 0), 2)}%** (goal <= 5%).")
    return out + [""] + _render_real_model(d)


def _render_real_model(d: dict[str, Any]) -> list[str]:
    """(f): SmolLM2-135M per rank at real scale, total peak (states + step) and the switch."""
    f = d.get("real_model", {})
    rows = []
    for c in f.get("configs", []):
        if c.get("ranks") and c.get("relative_error") is not None:
            measured = max(r.get("measured_total_bytes", r.get("peak_total_bytes", 0)) for r in c["ranks"])
            pred = c.get("predicted_total_bytes", c.get("predicted_bytes")) or 0
            rows.append([c["case"], pred / 2**20, measured / 2**20, f"{100 * c['relative_error']:+.1f}%",
                         c.get("measured_at", ""), "yes" if c.get("scored", True) else "no"])
    if not rows:
        return []
    out = ["(f) SmolLM2-135M per rank (gloo ranks, real `train_step`; `+bf16`: trainer.dtype=bf16), predicted vs "
           "measured peak above the runtime (MiB):", ""]
    out += _table(["case", "predicted", "measured (worst rank)", "error", "measured at", "scored"], rows)
    out.append(f"Largest relative error: **{fmt(100 * (d.get('max_relative_error_real_model') or 0), 2)}%** (goal <= 5%); "
               f"largest under-prediction: **{fmt(100 * (d.get('max_underprediction_real_model') or 0), 2)}%** "
               "(goal <= 2%).")
    return out + [""]


def render_weight_sync(d: dict[str, Any]) -> list[str]:
    rows = [[c["size"], c["plan"], c["method"], c["bytes"] / 2**20, c["publish_seconds"], c["pull_seconds"],
             c["total_seconds"], c["transport"]] for c in d.get("configs", [])]
    out = _table(["model", "plan", "method", "MiB", "publish s", "pull s", "publish + pull s", "transport"], rows)
    ratios = ", ".join(f"{k}: {fmt(v)}x" for k, v in d.get("full_over_sharded_total_seconds", {}).items())
    out.append(f"Full copy / sharded, publish + pull: {ratios}. Medians over {fmt(d.get('repetitions'))} "
               "repetitions, 2 trainer ranks.")
    return out + [""]


def render_selector(d: dict[str, Any]) -> list[str]:
    """Per phase: the adaptive run's plan, throughput and peak vs the per-rank budget, the oracle; then
    which static plans crashed and which plans the adaptive run adopted (`plans_used`)."""
    phases = d.get("adaptive_phases")
    if not phases:  # results of the single-process bench (before plans_used)
        return render_generic(d)
    oracle, plan = d.get("oracle_per_phase", []), d.get("oracle_plan_per_phase", [])
    ratio = d.get("adaptive_vs_oracle_per_phase", [])
    rows = [[ph["max_len"], "/".join(ph["plans"]), ", ".join(str(r).lower() for r in ph["recompute"]),
             ph["tokens_per_cpu_second"], ph["peak_bytes"] / 2**20, ph["budget_bytes"] / 2**20,
             oracle[i] if i < len(oracle) else None, plan[i] if i < len(plan) else None,
             ratio[i] if i < len(ratio) else None] for i, ph in enumerate(phases)]
    out = _table(["episodes up to (tokens)", "adaptive plan", "recompute", "tokens/rank-CPU-s", "peak MiB/rank",
                  "cap MiB/rank", "oracle tokens/s", "oracle plan", "adaptive / oracle"], rows)
    out.append(f"Static plans that ran out of memory: {d.get('static_crashes')} of {len(d.get('static_plans', []))} "
               f"({', '.join(d.get('static_crashed', [])) or 'none'}); adaptive crashed: "
               f"{fmt(d.get('adaptive_crashed'))}; `adaptive_vs_oracle_throughput` = "
               f"**{fmt(d.get('adaptive_vs_oracle_throughput'))}**; `plans_used`: "
               f"{', '.join(f'`{p}`' for p in d.get('plans_used', []))}.")
    return out + [""]


def render_cost_calibration(d: dict[str, Any]) -> list[str]:
    """Each measured configuration (wall and CPU seconds, the fit's), then the fitted coefficients."""
    rows = [[r["layout"], r["seq_len"], str(r["recompute"]).lower(), r["micro_batches"], r["wall_seconds"],
             r["cpu_seconds"], r["predicted_seconds"]] for r in d.get("calibration", [])]
    out = _table(["layout", "tokens per row", "recompute", "micro-batches", "wall s", "CPU s", "fitted s"], rows)
    coef = ", ".join(f"`{k}` {fmt(v)}" for k, v in d.get("cost_model", {}).items())
    out.append(f"Fitted on wall seconds: {coef}. Relative error of the fit: mean "
               f"{fmt(d.get('fit_mean_relative_error'))}, largest {fmt(d.get('fit_max_relative_error'))}.")
    return out + [""]


def render_learning(d: dict[str, Any]) -> list[str]:
    keys = ("env", "budget_minutes", "window_games", "target_win_rate", "start_win_rate", "max_win_rate",
            "final_win_rate", "mean_win_rate_second_half", "min_win_rate_second_half", "median_win_stderr_second_half",
            "median_groups_per_window_second_half", "time_to_target_s", "steps")
    rows = [[k, d.get(k)] for k in keys if k in d]
    if d.get("mean_outcomes_second_half"):
        rows.append(["mean_outcomes_second_half", ", ".join(f"{o} {fmt(r)}" for o, r in
                                                           d["mean_outcomes_second_half"].items())])
    if "overrides" in d:
        rows.append(["overrides", " ".join(d["overrides"]) or "none (the embedded default)"])
    return _table(["result", "value"], rows) + _said(d)


def render_algorithms(d: dict[str, Any]) -> list[str]:
    out = [f"{fmt(d.get('budget_minutes'))} minutes per run, seeds {fmt(d.get('seeds'))}, win rate over the last "
           f"{d.get('window_games')} games; spread = max - min over the seeds of the second-half mean; exact = the "
           "final checkpoint's own win rate (`bench/policy_audit.py`: every game it can play, weighted by its "
           "probability), free of a window's sampling error.", ""]
    rows = [[c["config"], c["seeds"], c["final_win_rate"], c["mean_win_rate_second_half"],
             c["min_win_rate_second_half"], c["spread_second_half_mean"], c["time_to_target_s"], c["steps"],
             c.get("exact_win_rate")]
            for c in d.get("configs", [])]
    return out + _table(["configuration", "seeds", "final", "2nd-half mean", "2nd-half min", "spread",
                         f"to {d.get('target_win_rate')} (s)", "steps", "exact"], rows) + _said(d)


def render_policy_audit(d: dict[str, Any]) -> list[str]:
    """One row per audited checkpoint: exact outcomes, value lost, and the position that loses the most."""
    rows = []
    for a in d.get("audits", []):
        o, worst = a["outcomes"], (a.get("worst") or [{}])[0]
        board = str(worst.get("board")).replace(" | ", " / ")  # a "|" would split the table's cell
        rows.append([a["checkpoint"].replace("/tmp/", "").replace("bench/results/", ""), o["win"], o["draw"], o["loss"],
                     o["illegal"], a["value_lost"], a["value_lost_deterministic"],
                     f"{board}: plays {worst.get('plays')} (p suboptimal {worst.get('p_suboptimal')}, "
                     f"loses {worst.get('value_lost')})" if worst else ""])
    out = ([f"Optimal play wins {d.get('optimal_win_rate')} against the random opponent.", ""] +
           _table(["checkpoint", "win", "draw", "loss", "illegal", "value lost", "of it where the top move is wrong",
                   "the position that loses the most"], rows))
    for ckpt, replies in d.get("replies", {}).items():  # `policy_audit.py --replies`
        wrong = [r for r in replies if r["q"] < r["v"] - 1e-9]
        out += [f"Third moves of {ckpt.replace('bench/results/', '')} along its own most likely line: "
                f"{len(wrong)} mistakes in {len(replies)} positions.", ""]
        out += _table(["X, O, X, O", "then X", "p", "Q*", "V*"],
                      [[f"{r['x_first']}, {r['o_first']}, {r['x_second']}, {r['o_second']}", r["x_third"], r["p_third"],
                        r["q"], r["v"]] for r in wrong])
    return out + _said(d)


def render_openai_endpoint(d: dict[str, Any]) -> list[str]:
    rows = []
    for model, per_env in d.get("models", {}).items():
        for env, r in per_env.items():
            s = r.get("summary", {})
            rows.append([model, env, s.get("builtin", {}).get("tokens_per_turn"),
                         s.get("builtin", {}).get("tokens_per_s"), s.get("endpoint", {}).get("tokens_per_s"),
                         s.get("endpoint_inprocess", {}).get("tokens_per_s"), r.get("endpoint_over_builtin_tokens_per_s"),
                         r.get("endpoint_over_builtin_per_rep"),
                         r.get("endpoint_inprocess_over_builtin_tokens_per_s"), "met" if r.get("goal_met") else "missed",
                         s.get("endpoint", {}).get("prefix_mismatches")])
    out = _table(["model", "env", "tokens/turn", "built-in tok/s", "endpoint tok/s (agent process)",
                  "endpoint tok/s (agent in event loop)", "endpoint / built-in", "per rep", "in event loop / built-in",
                  "goal >= 0.8", "prefix mismatches"], rows)
    return out + [f"{d.get('episodes')} concurrent episodes, medians of {d.get('reps')} alternating repetitions, "
                  f"{d.get('agent_processes', 1)} agent process(es), {d.get('threads')} torch thread(s).", ""] + _said(d)


def render_sandbox(d: dict[str, Any]) -> list[str]:
    """bench/sandbox.py: episodes/s per mode (mean [95% interval]) in each arm, and each arm's ratios to none."""
    def ci(x: Any, key: str = "mean") -> str:
        return f"{fmt(x.get(key))} [{fmt(x.get('low'))}, {fmt(x.get('high'))}]" if isinstance(x, dict) else "—"

    env = d.get("env_arm", {})
    arms = [("environment from a file, children reused", env, env.get("bwrap_vs_none"), env),
            ("agent programs, processes started each round", d, d.get("agent_bwrap_vs_none"), d)]
    rows = [[name, *(ci(a.get("episodes_per_s", {}).get(m)) for m in ("none", "process", "bwrap")),
             ci(a.get("process_vs_none"), "ratio"), ci(bwrap, "ratio"), f"{fmt(n.get('reps'))} x {fmt(n.get('episodes'))}"]
            for name, a, bwrap, n in arms]
    out = _table(["arm", "none episodes/s", "process", "bwrap", "process / none", "bwrap / none", "rounds x episodes"],
                 rows)
    load = ", ".join(fmt(x, 2) for x in (d.get("load_average_at_start") or [])[:1] + (d.get("load_average_at_end") or [])[:1])
    out += [f"Goal ({d.get('goal', 'bwrap >= 0.8 x none')}): **{'met' if d.get('goal_met') else 'missed'}** "
            f"(mean ratio). Load average (1 min) at start and end: {load}.", ""]
    return out + _said(d)


def render_context_growth(d: dict[str, Any]) -> list[str]:
    """Both runs side by side; the adaptive run's plan changes; the finding."""
    rows = []
    for kind in ("static", "adaptive", "static_unbounded"):
        if kind not in d:
            continue
        r = d[kind]
        rows.append([kind, r.get("final_success"), r.get("best_success"), r.get("truncated_fraction"),
                     r.get("crashed") or "no", r.get("steps"), r.get("max_context_p99"),
                     ", ".join(r.get("plans_used", [])), r.get("peak_mib_above_start"), r.get("cap_mib")])
    out = _table(["run", "final success (last fifth)", "best success", "truncated (last fifth)", "crashed", "steps",
                  "max context p99", "trainer plans (name/micro-batch tokens)", "peak MiB above start (max rank)",
                  "cap MiB"], rows)
    changes, last = [], None
    for p in d.get("adaptive", {}).get("curve", []):
        if p.get("plan") and p["plan"] != last:
            changes.append(f"{p['plan']} at step {p['step']} (t {fmt(p['t'])} s, context p99 "
                           f"{fmt(p.get('context', {}).get('p99'))})")
            last = p["plan"]
    if changes:
        out += ["Adaptive run's trainer plans: " + "; ".join(changes) + ".", ""]
    return out + _said(d)


def render_e2e(d: dict[str, Any]) -> list[str]:
    """bench/e2e.py: the repeated comparison (async, sync with all cores, TRL) and the staleness ablation; results
    of the earlier single-run format keep their old table (`_render_e2e_single`)."""
    if "runs" not in d and "staleness_ablation" not in d and "smollm2" not in d:
        return _render_e2e_single(d)

    def ci(x: Any) -> str:
        if not isinstance(x, dict):
            return "—"
        if x.get("mean") is None and x.get("at_most") is not None:  # a bound: the baseline never got there
            return f"<= {fmt(x['at_most'])}"
        lo, hi = x.get("ci95") or [x.get("low"), x.get("high")]
        return f"{fmt(x.get('mean'))} [{fmt(lo)}, {fmt(hi)}]" if lo is not None else fmt(x.get("mean"))

    out = [f"Same model, game (Tic-Tac-Toe vs random), group size {d.get('group_size')}, "
           f"{d.get('samples_per_step')} samples per step, lr {d.get('lr')}; win rate over the last "
           f"{d.get('stats_window_games')} games; target {d.get('target_win_rate')}.", ""]
    if d.get("runs"):
        cores = d.get("core_assignment", {})
        if "comparison" in (d.get("part_provenance") or {}):  # kept from an earlier run: `core_assignment` is the
            probes = d.get("thread_probes") or {}             # later part's; the probes are this part's own record
            cores = {arm: {"all CPUs, not pinned": f"{probes[arm]['chosen']} torch thread(s), the faster in its probe"}
                     if (probes.get(arm) or {}).get("chosen") else c for arm, c in cores.items()}
        rows = [[arm, len(rs), ci((d.get("samples_per_s") or {}).get(arm)), ci((d.get("loss_tokens_per_s") or {}).get(arm)),
                 ", ".join(fmt(t) for t in (d.get("time_to_target_s") or {}).get(arm, [])),
                 "; ".join(f"{k}: {v}" for k, v in cores.get(arm, {}).items())] for arm, rs in d["runs"].items()]
        out += _table(["system", "repeats", "samples/s", "loss tokens/s", "s to target per repeat (from launch)",
                       "cores"], rows)
        out += [f"Async over the ceiling its pools allow: **{ci(d.get('async_vs_ceiling'))}** (goal >= 0.95); async / "
                f"sync with all cores: **{ci(d.get('async_vs_sync'))}**; async / TRL (samples/s): "
                f"{ci(d.get('async_vs_trl'))}; time to target, earl_stream / TRL: "
                f"**{ci((d.get('time_to_target_vs_trl') or {}).get('default_model'))}** (goal <= 0.75).", ""]
    if d.get("staleness_ablation"):
        rows = [[k, ", ".join(fmt(t) for t in r.get("seconds_to_target", [])),
                 ", ".join(fmt(f) for f in r.get("final_win_rate", [])), ci(r.get("final_win_rate_mean"))]
                for k, r in d["staleness_ablation"].items()]
        out += [f"Staleness ablation ({fmt(d.get('ablation_seconds'))} s a run after its first step):", ""]
        out += _table(["max_staleness", "s to target per seed", "final win rate per seed", "final mean [95%]"], rows)
    if d.get("smollm2"):
        out += _render_e2e_smollm2(d["smollm2"], ci)
    return out + _said(d)


def _render_e2e_smollm2(p: dict[str, Any], ci: Any) -> list[str]:
    """Part smollm2: per system, held-out success at the budget, loss tokens/s, seconds to the target per seed;
    then each run's held-out curve (seconds from launch: success)."""
    before, target = p.get("heldout_before") or {}, p.get("target_success")
    out = [f"SmolLM2-135M-Instruct on {p.get('config')}, {fmt((p.get('budget_s') or 0) / 60)} min a run from launch, "
           f"{p.get('seeds')} seeds a system; held-out success ({p.get('problems')} problems, greedy) from "
           f"{fmt(before.get('success'))}, target {fmt(target)} (+{fmt(p.get('target_gain'))}).", ""]
    rows = [[system, ci((p.get("heldout_at_budget") or {}).get(system)),
             ci((p.get("loss_tokens_per_s") or {}).get(system)),
             ", ".join(fmt(t) if t is not None else "never" for t in (p.get("time_to_target_s") or {}).get(system, [])),
             (p.get("core_assignment") or {}).get(system, "")] for system in (p.get("runs") or {})]
    out += _table(["system", "held-out at the budget", "loss tokens/s", "s to target per seed", "cores"], rows)
    out += [f"Time to target, earl_stream / TRL: **{ci(p.get('time_to_target_vs_trl'))}** (goal <= 0.75).", ""]
    curves = [[system, run.get("seed"), "; ".join(f"{fmt(h['t'])} s: {fmt(h['success'])}" for h in run.get("heldout", []))]
              for system, runs in (p.get("runs") or {}).items() for run in runs]
    out += _table(["system", "seed", "held-out success by checkpoint (seconds from launch)"], curves)
    return out + ["**Notes:** " + " ".join(p.get("notes") or []), ""]


def _render_e2e_single(d: dict[str, Any]) -> list[str]:
    out = [f"Same model, game (Tic-Tac-Toe vs random), group size {d.get('group_size')}, "
           f"{d.get('samples_per_step')} samples per step, lr {d.get('lr')}; {fmt(d.get('seconds_per_system'))} s "
           f"measured per system after its first step; win rate over the last {d.get('stats_window_games')} games.",
           ""]
    rows = []
    for name, r in d.get("systems", {}).items():
        if "error" in r:
            rows.append([name, "failed", None, None, None, None, None, None])
            continue
        cores = ", ".join(f"{k}: {v}" for k, v in d.get("core_assignment", {}).get(name, {}).items())
        rows.append([r.get("system", name), r.get("samples_per_s"), r.get("generated_tokens_per_s"),
                     r.get("trained_tokens_per_s"), r.get("steps_per_s"), r.get("cpu_seconds_per_sample"),
                     r.get("start_win_rate"), r.get("final_win_rate"), r.get("time_to_target_s"), cores])
    out += _table(["system", "samples/s", "generated tok/s", "trained tok/s", "steps/s", "CPU-s/sample",
                   "first win rate", "last win rate", f"s to win rate {d.get('target_win_rate')} (from launch)",
                   "cores"], rows)
    tg = d.get("targets", {})
    out.append(f"**async / sync = {fmt(d.get('async_vs_sync'))}** (target {tg.get('async_vs_sync')}), "
               f"**async / TRL = {fmt(d.get('async_vs_trl'))}** (target {tg.get('async_vs_trl')}); "
               f"targets missed: {', '.join(d.get('targets_missed') or []) or 'none'}.")
    out.append("")
    if d.get("async_vs_sync_ceiling"):
        out += [f"Ceiling of async / sync for this core split: {fmt(d['async_vs_sync_ceiling'])} "
                f"({d.get('ceiling_note')}).", ""]
    out += [f"- {f}" for f in d.get("findings", [])] + ([""] if d.get("findings") else [])
    sd = d.get("sample_definition", {})
    out += [f"A sample: earl_stream — {sd.get('earl_stream')}; TRL — {sd.get('trl')}.", ""]
    prof = {k: v.get("profile") for k, v in d.get("systems", {}).items() if v.get("profile")}
    if prof:
        out += ["Where the time goes (fractions of the measured window; CPU = cores used by that process):", ""]
        flat = {name: {**{f"CPU {k}": v for k, v in p.get("cpu_utilisation", {}).items()},
                       **{k.replace("_", " "): v for k, v in p.items() if isinstance(v, (int, float))}}
                for name, p in prof.items()}
        measures = list(dict.fromkeys(m for f in flat.values() for m in f))
        out += _table(["measure", *flat], [[m, *(f.get(m) for f in flat.values())] for m in measures])
        out += [f"- {name}: {p['note']}" for name, p in prof.items() if p.get("note")] + [""]
    return out
