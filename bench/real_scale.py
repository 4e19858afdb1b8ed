"""SmolLM2-135M trained by GRPO on episodes whose context grows 8.6x, a trainer pool of 2 ranks under a real
per-rank memory cap: the adaptive selector side by side with every static plan a user would configure (each
with its token cap tuned until it fits) and the trainer's per-micro-batch dynamic sequence parallelism.

    python bench/real_scale.py --json bench/results/real_scale.json                   # smollm2 setting (~85 min)
    python bench/real_scale.py --resume --json bench/results/real_scale.json          # continue a killed campaign
    python bench/real_scale.py --setting heads8 --json bench/results/real_scale_heads8.json   # (~155 min)
    python bench/real_scale.py --quick --json /tmp/real_scale_quick.json [--only adaptive,static:fsdp2+rc]

The workload (configs/smollm2_real_scale.yaml, envs/long_recall.py with `facts_last`): a document of filler words,
then two facts and the question for one of them, one reply of up to 8 tokens, reward 1 for the right value. The
facts sit next to the question, so SmolLM2-135M-Instruct earns reward at every length: before training, greedy, 24
items per length, 0.46 +- 0.10 (standard error) at ~118 tokens, 0.46 +- 0.10 at ~200, 0.38 +- 0.10 at ~420 and 0.67
+- 0.10 at ~1,015 (measured with the earlier sizes: 48 words x2.7); sampled at the rollout's temperature 0.7,
0.21 +- 0.06 of 48 episodes at ~118 (at 1.0, 0.13: a phase would often see no reward). A step trains 8 sequences
(2 prompt groups x GRPO groups of 4); the document grows x3.3 per level over 4 levels (20 filler words at the
first), 3 steps each (`level_groups`): 92, 138, 290 and 791 tokens per episode in SmolLM2's chat template (8.6x),
so 9 of the 12 steps are at the short and middle lengths and the last 3 are the tail at the longest. At 8 x 791
tokens a step, under the 4.5 GiB cap, micro-batch size, recomputation and sharding are meant to change the step time
(a replica with AdamW holds 2.2 GiB, the fp32 logits ~0.6 GiB per 1,024 micro-batch tokens; the token-cap probes
measure where each plan stops fitting; in --quick at 4.4 GiB, dp2 was OOM-killed in its longest phase). Held-out
success (greedy, --heldout-problems items spread over the 4 lengths, evaluation seeds no run trains on) of the base
model (`heldout_before`) and of the adaptive run's last checkpoint (`heldout_after`), each with its standard error;
rewards per phase from the trainer's step log (`reward_per_phase`).

Two model settings (--setting):
- smollm2: the real weights (`make real-model`), learning; its 9 attention heads allow dp/FSDP and
  recomputation only. Arms: adaptive, static dp2, dp2+rc, fsdp2, fsdp2+rc.
- heads8: SmolLM2's size (hidden 576, 30 layers, its vocabulary and tokenizer) with 8 attention and 4 KV heads,
  random weights, built once under ~/.cache/earl_stream/models/ and loaded from there (systems only: rewards
  are ~0). Arms: adaptive, dynamic_sp, static dp2, fsdp2, tp2, sp2, each with and without recomputation.

Every arm is one `earl-stream up` on the same seeds, environment, steps and cap:
- adaptive: the selector on (it re-plans dp/FSDP2/tp/sp, recomputation and the micro-batch budget as the context
  percentiles cross its thresholds), told the cap less --reserve-gib, starting from a cost model calibrated on
  these CPUs (--cost-model; for heads8 on its own model by bench/cost_calibration.py, as a user calibrates once
  on new hardware; each adaptive run records the file it started from);
- static:<plan>: one layout for the whole run, no memory model (the selector is told 1 TiB), and verl-style
  dynamic batching: micro-batches filled up to a token cap (bench/real_scale_site sets the selector's largest
  micro-batch). The cap is what a user tunes until the plan fits: before the plan's first run the benchmark
  probes it (--probe-steps steps with every episode at the longest length), from the whole step on one rank down
  to the longest episode, halving, and keeps the largest that survives (`token_caps`, with every probe). A plan
  whose first run is OOM-killed (in a shorter phase, whose micro-batches hold more rows, or at the smallest of
  --max-probes caps that all failed) runs again at half that cap while it is no shorter than the longest
  episode, as its user would (each crashed run is kept among the probes, `full_run`). A plan
  that survives no cap runs at the smallest and meets its crash; one the pool or the model cannot run "does not
  start", with its reason;
- dynamic_sp (heads8): verl's dynamic context parallelism as the trainer runs it (`trainer.dynamic_sp_tokens`):
  the sharding fixed at fsdp2 with fsdp2's token cap, and a row longer than midway between the last two phases'
  lengths trained by both ranks at Ulysses sp=2 in a micro-batch of its own (`dynamic_sp_real`: true).
Each trainer rank is capped before it imports torch (bench/real_scale_site: a memory cgroup of its own, or
setrlimit with --cap-mode rlimit) at --cap-gib. Past the cap the kernel kills the rank (or torch raises): a crash.
A run that ends early without one (e.g. `up` gave up) is `stopped`, with its reason, never a crash.

Recorded per run from the trainer's log and the supervisor's status: crashes (and the allocation error), refused
or truncated samples, trained tokens per training second per context phase (and per rank-CPU-second, from /proc),
the plans adopted, each re-layout's measured peak and each rank's peak.

Repeats (--repeats, default 3): a first pass runs every arm once; then adaptive, dynamic_sp and the
--repeat-static (default 2) static plans fastest end to end in that pass run again, with any other static plan whose
one run beats the fastest repeated plan's mean (which plans are fastest depends on the machine: measured, not named
beforehand), interleaved (adaptive, dynamic_sp, static:a, ..., adaptive, ...), so load drifts hit every arm
alike. From all repeats (bench/real_scale_summary.py): repeats, end_to_end_seconds (first
step's start to last step's end: re-plans, switches and idle waits included), vs_best_static_end_to_end (the best
crash-free static plan's mean over adaptive's, with ci95), static_oracle (each phase trained by the static plan
fastest in it, switches free: the most any plan choice could gain over the best static plan), tuning_seconds and
vs_best_static_with_tuning (what the probes that found each static cap took, and the comparison with the best
static plan's added: the main comparison gives the static plans their caps for free), per_phase (plans and tokens/s with ci95),
phase_vs_fastest_static and same_plan_phases (a phase where both sides ran the same plan is never a speedup or a
loss), vs_fastest_static_min_differing, reward_per_phase, dynamic_sp_real, heldout_before, heldout_after,
token_caps, and repeat_runs (the repeats after the first).

Budget. The sizes are the smallest the comparison allows: 8 sequences a step, 3 steps a phase, 4 phases growing
8.6x; a run then trains ~31,500 tokens, ~10.5 minutes at ~60 trained tokens/s (2 cores) with start-up by the
printed estimate (--rate: the tokens/s to plan with), 5-8 minutes as measured. The smollm2 setting (5 arms, then 3
repeated twice, 8 probes) took 81 minutes on an Intel Xeon; heads8 (10 arms, then 4 repeated twice, ~24 probes)
took 153 there, in two parts (43 + 110 minutes) joined by --resume on the same CPU.
Each run records its commit and CPU (`measured`);
--resume continues a killed campaign (across sessions of a machine lent for less time than a campaign takes), and
it and --only keep from the file only what was measured at the same measured code on the same CPU: the rest runs
again, so one file compares one code on one machine.
--quick (3 phases of one step, ~94 -> ~220 tokens, a 4.4 GiB cap, one repeat, at most 2 probes per plan, 15
held-out items) checks the whole pipeline in ~35 minutes of the smollm2 setting on an idle machine (the estimate
printed says 34); under a load of 10-20 on the 2 cores it trained ~8-14 tokens/s and took over an hour.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from live_up import stop_on_sigterm  # noqa: E402  (bench/, beside this script)
from real_scale_run import RUN_OVERHEAD_S, SMOLLM2_DIR, build_heads8_model, find_token_cap, heldout, phase_lengths, run  # noqa: E402
from real_scale_summary import end_to_end_seconds, summarize_repeats, tuning  # noqa: E402

from bench.provenance import catalogued_depends_on, other_measurement, run_stamp, write_result  # noqa: E402


def strategies(nproc: int, setting: str) -> list[str]:
    """The arms of a model setting: SmolLM2's 9 heads allow dp/FSDP (and recomputation) only; the 8-head shape
    adds tp and sp and the per-micro-batch dynamic sequence-parallel policy."""
    layouts = (f"dp{nproc}", f"fsdp{nproc}") if setting == "smollm2" else \
        (f"dp{nproc}", f"fsdp{nproc}", f"tp{nproc}", f"sp{nproc}")
    static = [f"static:{p}{rc}" for p in layouts for rc in ("", "+rc")]
    return ["adaptive", *(["dynamic_sp"] if setting == "heads8" else []), *static]


def retune(kind: str, repeat: int, r: dict[str, Any], cap: int, longest: int) -> bool:
    """Whether a static plan's first run, OOM-killed at token cap `cap`, runs again at half of it (not below the
    longest episode), as the user who tunes the cap until the run fits would. The probes fill micro-batches with
    the longest phase's episodes, and a shorter phase packs more rows into the same cap (7 x 290 tokens against
    2 x 800 under 2,048); and --max-probes may stop the halving before the cap that fits."""
    if not kind.startswith("static:") or repeat or not r["crashed"] or not cap:
        return False
    return cap // 2 >= longest


def estimate_seconds(args: argparse.Namespace, kinds: list[str], rate: float) -> dict[str, float]:
    """What the benchmark should take on this machine: every run's tokens at `rate` trained tokens/s plus a
    start-up per run (a first pass over `kinds`, then the repeats of the strategies `repeated` keeps, counting
    --repeat-static static plans); the token-cap probes (two per static plan, a guess) at the longest length."""
    lengths = phase_lengths(args)
    per_step = args.groups_per_step * args.group_size
    run_s = RUN_OVERHEAD_S + sum(per_step * args.steps_per_phase * n for n in lengths) / rate
    probe_s = RUN_OVERHEAD_S + args.probe_steps * per_step * lengths[-1] / rate
    statics = sum(k.startswith("static:") for k in kinds)
    probes = 2 * (statics + ("dynamic_sp" in kinds))
    again = len(kinds) - statics + (min(statics, args.repeat_static) if args.repeat_static else statics)
    runs = len(kinds) + (args.repeats - 1) * again
    return {"per_run_s": round(run_s), "per_probe_s": round(probe_s), "probes": probes, "runs": runs,
            "total_s": round(runs * run_s + probes * probe_s)}


def aggregate(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The result's keys from the runs: adaptive against the best static plan and the dynamic policy (missing
    strategies give None)."""
    adaptive, dynamic = runs.get("adaptive"), runs.get("dynamic_sp")
    static = {k.split(":", 1)[1]: r for k, r in runs.items() if k.startswith("static:")}
    levels = args.levels

    def survived(r: dict[str, Any], k: int) -> bool:  # trained phase k and did not crash (or stop) in it
        return r["started"] and r["phases"][k]["steps"] > 0 and r["crash_phase"] != k

    def versus(key: str) -> list[dict[str, Any]]:  # adaptive over the best surviving static plan, per phase
        out = []
        for k in range(levels):
            best = max(((n, r["phases"][k].get(key)) for n, r in static.items() if survived(r, k)
                        and r["phases"][k].get(key)), key=lambda x: x[1], default=(None, None))
            mine = adaptive["phases"][k].get(key) if adaptive else None
            out.append({"phase": k, f"adaptive_{key}": mine, "best_static": best[0], f"best_static_{key}": best[1],
                        "ratio": round(mine / best[1], 3) if mine and best[1] else None})
        return out

    per_phase, per_phase_cpu = versus("tokens_per_s"), versus("tokens_per_cpu_s")
    ratios = [p["ratio"] for p in per_phase if p["ratio"] is not None]
    ratios_cpu = [p["ratio"] for p in per_phase_cpu if p["ratio"] is not None]

    def rate(r: dict[str, Any] | None) -> float | None:
        return r["trained_tokens"] / r["train_seconds"] if r and r["train_seconds"] else None

    growth = None
    if adaptive:
        p99 = [p["p99_episode_tokens"] for p in adaptive["phases"] if p["p99_episode_tokens"]]
        growth = round(p99[-1] / p99[0], 2) if len(p99) >= 2 else None
    return {
        "adaptive_crashed": adaptive["crashed"] if adaptive else None,
        "adaptive_truncated": adaptive["truncated"] if adaptive else None,
        "static": {n: {"started": r["started"], "start_error": r["start_error"], "crashed": r["crashed"],
                       "stopped": r.get("stopped", False), "crash_phase": r["crash_phase"], "end_reason": r["crash_reason"],
                       "truncated": r["truncated"],
                       "tokens_per_s": [p["tokens_per_s"] for p in r["phases"]],
                       "tokens_per_cpu_s": [p.get("tokens_per_cpu_s") for p in r["phases"]], "plans_used": r["plans_used"],
                       "trained_tokens": r["trained_tokens"]} for n, r in static.items()},
        "vs_best_static_min": min(ratios) if ratios else None,
        "vs_best_static_per_phase": per_phase,
        # the same per rank-CPU-second (the runs follow each other on a shared machine whose load varies)
        "vs_best_static_min_cpu": min(ratios_cpu) if ratios_cpu else None,
        "vs_best_static_per_phase_cpu": per_phase_cpu,
        # trained tokens over the run (same steps and time budget; a crash ends a run)
        "vs_dynamic_sp": round(adaptive["trained_tokens"] / dynamic["trained_tokens"], 3)
        if adaptive and dynamic and dynamic["trained_tokens"] else None,
        # and per second of training while both ran (the phases the dynamic policy survived weigh in)
        "vs_dynamic_sp_tokens_per_s": round(rate(adaptive) / rate(dynamic), 3) if rate(adaptive) and rate(dynamic)
        else None,
        "dynamic_sp": {k: dynamic[k] for k in ("crashed", "stopped", "crash_phase", "crash_reason", "truncated",
                                               "plans_used", "trained_tokens")}
        | {"tokens_per_s": [p["tokens_per_s"] for p in dynamic["phases"]]} if dynamic else None,
        "plans_used": adaptive["plans_used"] if adaptive else None,
        "switch_peak_bytes": [max(s["peak_rss_bytes"].values(), default=0) for s in adaptive["switches"]]
        if adaptive else None,
        "context_growth": growth,
        "static_crashed_any": any(r["crashed"] for r in static.values()),
    }


def table(result: dict[str, Any], runs: dict[str, dict[str, Any]]) -> str:
    rows = [f"{'strategy':18s} {'start':5s} {'crash':5s} {'phase':5s} {'steps':>5s} "
            + " ".join(f"{'tok/s p' + str(k):>10s}" for k in range(len(next(iter(runs.values()))['phases'])))
            + "  plans"]
    for name, r in runs.items():
        tps = " ".join(f"{p['tokens_per_s'] or 0:10.1f}" for p in r["phases"])
        rows.append(f"{name:18s} {str(r['started'])[0]:5s} {str(r['crashed'])[0]:5s} "
                    f"{'' if r['crash_phase'] is None else r['crash_phase']!s:5s} {r['steps']:5d} {tps}  "
                    f"{' -> '.join(r['plans_used']) or r['start_error'][-80:]}")
    keys = ("adaptive_crashed", "adaptive_truncated", "vs_best_static_min", "vs_best_static_min_cpu", "vs_dynamic_sp",
            "plans_used", "switch_peak_bytes", "context_growth", "static_crashed_any", "repeats", "end_to_end_seconds",
            "vs_best_static_end_to_end", "static_oracle", "vs_best_static_with_tuning", "same_plan_phases",
            "vs_fastest_static_min_differing", "reward_per_phase", "dynamic_sp_real", "heldout_before", "heldout_after", "token_caps")
    return "\n".join(rows + [f"{k}: {result[k]}" for k in keys])


def repeated(kinds: list[str], runs: dict[str, Any], later: dict[str, list[Any]], top: int) -> list[str]:
    """The strategies the campaign repeats after its first pass (in `kinds`' order): adaptive and dynamic_sp; of
    the static plans that trained to the end in the first pass, the `top` fastest end to end there (0: all), any
    that a repeat has already started, and any whose one run beats the mean of the fastest repeated plan so far.
    Which static plans are fastest depends on the machine, so it is measured, not named beforehand; and a plan run
    once never ends up as the best static plan the comparison names, whose ratio would then have no interval."""
    alive = [k for k in kinds if k.startswith("static:") and runs[k]["started"] and not runs[k]["crashed"]
             and not runs[k]["stopped"]]
    seconds = {k: end_to_end_seconds(runs[k]) or float("inf") for k in alive}
    ranked = sorted(alive, key=seconds.__getitem__)
    chosen = set(ranked[:top] if top else ranked) | {k for k in alive if later.get(k)}

    def mean_seconds(kind: str) -> float:
        done = [s for r in [runs[kind], *later.get(kind, [])] if (s := end_to_end_seconds(r)) is not None]
        return statistics.fmean(done) if done else float("inf")

    best = min(map(mean_seconds, chosen), default=float("inf"))
    chosen |= {k for k in alive if seconds[k] < best}
    return [k for k in kinds if not k.startswith("static:") or k in chosen]


def next_run(kinds: list[str], runs: dict[str, Any], later: dict[str, list[Any]], repeats: int,
             top: int = 0) -> tuple[str, int] | None:
    """The campaign's next (strategy, repeat index), None when it is complete: a first pass over every strategy,
    then the repeats interleaved (A B C A B C ...) over the strategies `repeated` keeps (`top`: how many of the
    fastest static plans; a static plan that crashed, stopped or did not start in the first pass is not repeated).
    `runs`: each strategy's first repeat; `later`: its repeats after the first (what a --resume found recorded
    counts as done)."""
    for kind in kinds:
        if kind not in runs:
            return kind, 0
    again = repeated(kinds, runs, later, top)
    for repeat in range(1, repeats):
        for kind in again:
            if len(later.get(kind, [])) < repeat:
                return kind, repeat
    return None


def keep_this_code(runs: dict[str, Any], later: dict[str, list[Any]], caps: dict[str, Any],
                   depends_on: list[str]) -> list[str]:
    """Drop from what a results file holds (first runs, repeats, probed token caps) every measurement that cannot
    stand beside runs measured now (`other_measurement`: another commit's measured code, another CPU, a dirty
    checkout, no record), so one file compares one code on one machine; returns a line per dropped measurement."""
    dropped = []
    for kind in list(runs):
        if why := other_measurement(runs[kind].get("measured"), depends_on):
            dropped.append(f"{kind} (and its {len(later.get(kind, []))} repeat(s)): {why}")
            runs.pop(kind)
            later.pop(kind, None)
    for kind, rs in later.items():
        kept = [r for r in rs if not other_measurement(r.get("measured"), depends_on)]
        if len(kept) < len(rs):
            dropped.append(f"{len(rs) - len(kept)} repeat(s) of {kind}")
        later[kind] = kept
    for plan in list(caps):
        if not caps[plan].get("given") and (why := other_measurement(caps[plan].get("measured"), depends_on)):
            dropped.append(f"the token-cap probes of {plan}: {why}")
            caps.pop(plan)
    return dropped


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=("smollm2", "heads8"), default="smollm2",
                    help="smollm2: the real SmolLM2-135M-Instruct weights (learning; dp/FSDP/recomputation arms); "
                         "heads8: its size with 8 attention and 4 KV heads, random weights (systems only; adds tp, sp "
                         "and the dynamic sequence-parallel arm)")
    ap.add_argument("--json", default="", help="results file, also the runs' parent dir (default: "
                    "bench/results/real_scale.json, or real_scale_heads8.json)")
    ap.add_argument("--quick", action="store_true",
                    help="the same experiment, smaller: 3 phases of one step, ~94 -> ~220 tokens per episode, one "
                         "repeat, at most 2 probes per plan (~35 minutes for the smollm2 setting on an idle machine)")
    ap.add_argument("--only", default="", help="comma-separated strategies to run (adaptive, dynamic_sp, "
                    "static:dp2, static:fsdp2+rc, ...); their results replace those in an existing --json")
    ap.add_argument("--runs-dir", default="", help="where each strategy's run directory goes (default: beside --json)")
    ap.add_argument("--nproc", type=int, default=2, help="trainer ranks")
    ap.add_argument("--cap-gib", type=float, default=4.5, help="memory cap of each trainer rank, all of its memory")
    ap.add_argument("--reserve-gib", type=float, default=0.7,
                    help="of the cap, what the selector keeps for what the memory model does not count: the runtime "
                         "(~0.5 GiB: Python, torch, gloo) and the allocator's slack")
    ap.add_argument("--cap-mode", choices=("cgroup", "rlimit"), default="cgroup",
                    help="cgroup: a memory cgroup per rank (root, resident memory, OOM kill); rlimit: RLIMIT_DATA")
    ap.add_argument("--filler-words", type=int, default=20, help="filler words per episode at level 0")
    ap.add_argument("--filler-factor", type=float, default=3.3, help="filler growth per level")
    ap.add_argument("--levels", type=int, default=4, help="context phases (curriculum levels)")
    ap.add_argument("--steps-per-phase", type=int, default=3, help="training steps per context phase")
    ap.add_argument("--groups-per-step", type=int, default=2, help="prompt groups per step")
    ap.add_argument("--group-size", type=int, default=4, help="episodes per prompt group (GRPO)")
    ap.add_argument("--probe-steps", type=int, default=2,
                    help="steps of a token-cap probe at the longest length (2: the second step's peak holds AdamW's "
                         "state, which the first allocates only after its backward pass; a one-step probe passed "
                         "dp2 at a cap where its run was then OOM-killed)")
    ap.add_argument("--max-probes", type=int, default=3, help="token caps tried per plan, largest first")
    ap.add_argument("--token-caps", default="", help="JSON {plan: tokens} that skips the probes of those plans")
    ap.add_argument("--heldout-problems", type=int, default=48, help="held-out items (spread over the phases)")
    ap.add_argument("--rate", type=float, default=60.0, help="trained tokens/s this machine gives (the estimate)")
    ap.add_argument("--initial-len", type=int, default=128, help="design length of the first plan (every strategy)")
    ap.add_argument("--cost-model", default=None,
                    help="the selector's starting cost model (selector.cost_model_path) for every run; by default the "
                         "calibration measured on these CPUs: for heads8 its own (bench/cost_calibration.py on the "
                         "8-head model, bench/results/cost_model_heads8.json), for smollm2 bench/selector.py's; '' = "
                         "the library's GPU-like defaults")
    ap.add_argument("--run-minutes", type=float, default=40.0, help="wall-clock limit of one strategy's run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="one more `up` override for every run (repeatable)")
    ap.add_argument("--rebuild", action="store_true", help="recompute the summary keys of --json from its runs")
    ap.add_argument("--resume", action="store_true",
                    help="continue the campaign recorded in --json: the strategies and repeats it holds are not run "
                         "again (its probes' token caps and held-out scores are kept); the rest follow in the usual "
                         "order (the first pass, then the interleaved repeats)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="runs per strategy (default 3; --quick: 1). A first pass runs every strategy once; static plans "
                         "that crashed or stopped in it are not repeated; the other repeats interleave the rest "
                         "(adaptive, dynamic_sp, static:a, adaptive, ...) so load drifts hit every arm alike")
    ap.add_argument("--repeat-static", type=int, default=2,
                    help="static plans repeated after the first pass: the N fastest end to end in it, and any other "
                         "whose one run beats the fastest repeated plan's mean (0: every static plan that survived). "
                         "Adaptive and dynamic_sp always repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.cap_gib, args.filler_words, args.filler_factor, args.levels = 4.4, 24, 2.5, 3
        args.steps_per_phase, args.heldout_problems, args.max_probes = 1, 15, 2
        args.run_minutes = min(args.run_minutes, 15.0)
    args.steps = args.levels * args.steps_per_phase
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.json = args.json or f"bench/results/real_scale{'_heads8' if args.setting == 'heads8' else ''}.json"
    if args.cost_model is None:
        args.cost_model = str(ROOT / "bench" / "results" / ("cost_model_heads8.json" if args.setting == "heads8"
                                                           else "selector.json"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()  # `kill` of the benchmark stops the run it is in
    args.model_dir = str(SMOLLM2_DIR if args.setting == "smollm2" else build_heads8_model())
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(args.runs_dir) if args.runs_dir else out.parent
    previous = json.loads(out.read_text()) if out.exists() and (args.only or args.rebuild or args.resume) else {}
    runs: dict[str, dict[str, Any]] = dict(previous.get("runs", {}))  # each strategy's first repeat
    later: dict[str, list[dict[str, Any]]] = dict(previous.get("repeat_runs", {}))  # its repeats after the first
    caps: dict[str, Any] = dict(previous.get("token_caps", {}))
    caps.update({k: {"tokens": v, "probes": [], "given": True} for k, v in json.loads(args.token_caps or "{}").items()})
    extra: dict[str, Any] = {"heldout_before": previous.get("heldout_before"), "estimate": previous.get("estimate")}
    kinds = args.only.split(",") if args.only else strategies(args.nproc, args.setting)
    if args.resume or args.only:  # what the file holds joins this run's measurements only if measured alike
        for line in keep_this_code(runs, later, caps, catalogued_depends_on(out)):
            print(f"   not kept from {out.name}, measured again: {line}", flush=True)

    replaced: dict[str, tuple[Any, list[Any]]] = {}  # --only without --resume: kept until their re-run replaces them

    def result_now() -> dict[str, Any]:
        first = {**{k: r for k, (r, _) in replaced.items() if r is not None and k not in runs}, **runs}
        more = {**{k: rs for k, (_, rs) in replaced.items() if k not in runs}, **later}
        every = {kind: [r, *more.get(kind, [])] for kind, r in first.items()}
        after = (first.get("adaptive") or {}).get("heldout")
        dyn = first.get("dynamic_sp")
        repeated = summarize_repeats(every, args.levels, dynamic_sp_real=bool(dyn and dyn["started"]))
        return {**aggregate(first, args), **repeated, **tuning(caps, repeated["vs_best_static_end_to_end"]),
                "heldout_before": extra["heldout_before"], "heldout_after": after, "token_caps": caps,
                "phase_episode_tokens": phase_lengths(args), "estimate": extra.get("estimate"),
                "settings": {k: v for k, v in vars(args).items() if k != "json"}, "runs": first, "repeat_runs": more}

    if args.rebuild:  # a summary of the runs recorded: when and where they were measured stays the file's
        rebuilt = result_now()
        rebuilt["settings"] = previous.get("settings") or rebuilt["settings"]
        write_result(out, rebuilt, indent=1, measured=previous.get("provenance"))
        print(table(rebuilt, runs))
        return 0
    extra["estimate"] = estimate_seconds(args, kinds, args.rate)
    print(f"estimate ({args.setting}, {args.rate:g} trained tokens/s): {extra['estimate']}", flush=True)
    if args.setting == "smollm2" and extra["heldout_before"] is None:
        extra["heldout_before"] = heldout(SMOLLM2_DIR, args)
        print(f"   held-out before training: {extra['heldout_before']}", flush=True)

    def measure(kind: str, repeat: int) -> dict[str, Any]:
        print(f"== {kind} (repeat {repeat + 1} of {args.repeats})", flush=True)
        plan = kind.split(":", 1)[1] if kind.startswith("static:") else f"fsdp{args.nproc}" if kind == "dynamic_sp" else ""
        if plan and plan not in caps:  # the token cap a user tunes until the plan fits the longest phase
            caps[plan] = {**find_token_cap(f"static:{plan}", args, runs_dir), "measured": run_stamp()}
        cap = (caps.get(plan) or {}).get("tokens") or 0
        if plan and not cap:  # no cap fits: the plan runs at its smallest probed cap and meets its crash (or fails to start)
            cap = min(p["tokens"] for p in caps[plan]["probes"]) if caps[plan]["probes"] else 0
        r = run(kind, args, runs_dir, token_cap=cap, evaluate=kind == "adaptive" and repeat == 0
                and args.setting == "smollm2")
        retuned = False
        while retune(kind, repeat, r, cap, (caps.get(plan) or {}).get("longest_episode_tokens", 0)):
            caps[plan]["probes"].append({"tokens": cap, "full_run": True, "started": True, "survived": False,
                                         "crashed": True, "reason": r["crash_reason"], "wall_seconds": r["wall_seconds"]})
            cap, retuned = cap // 2, True
            print(f"   {kind} was OOM-killed in phase {r['crash_phase']}: again at a {cap}-token cap", flush=True)
            r = run(kind, args, runs_dir, token_cap=cap)
        if retuned:
            caps[plan]["tokens"] = None if r["crashed"] else cap
        r["measured"] = run_stamp()
        print(f"   started {r['started']} crashed {r['crashed']} ({r['crash_reason']}) steps {r['steps']} "
              f"tokens {r['trained_tokens']} plans {r['plans_used']} {r['start_error'][-200:]}", flush=True)
        return r

    if not args.resume:  # run these again; what the file holds of them stays in it until a re-run replaces it
        for kind in kinds:
            replaced[kind] = (runs.pop(kind, None), later.pop(kind, None) or [])
    while (due := next_run(kinds, runs, later, args.repeats, args.repeat_static)) is not None:
        kind, repeat = due
        r = measure(kind, repeat)
        if repeat == 0:
            runs[kind], later[kind] = r, []
        else:
            later[kind].append(r)
        write_result(out, result_now(), indent=1)  # after every run: a killed benchmark keeps what it measured
    print(table(result_now(), runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
