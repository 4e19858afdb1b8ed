"""Weight swaps mid-generation: rollout throughput, pause per version, staleness and learning of each
`rollout.weight_swap` mode (drain, interrupt, inplace), on `earl-stream up` runs (real processes: two
rollout workers, one trainer, the built-in engine).

    python bench/weight_swap.py [--minutes 2] [--repeats 3] [--modes drain,interrupt,inplace] [--model DIR] \
        --json bench/results/weight_swap.json

Every arm runs `--repeats` times, the modes interleaved (drain, interrupt, inplace, drain, ...) so that load
drifts hit all alike; each mode's rollout tokens/s is reported as the mean with its 95% interval, and each
mode over drain as a ratio of means with its interval (`bench/stats.py`). `default_mode` is what
`rollout.weight_swap=auto` runs on the built-in engine and `default_vs_drain` its pipeline ratio.

The environment (`LongReply`, below, loaded by path) asks for one reply of 64-256 tokens (drawn per
episode from its seed: the long tail a drain waits for) and rewards the share of digits in it; the
embedded model is taken without its warm start (`model.warm_start_steps=0`), so replies run to their
token limit rather than stopping after a move. `--model DIR` runs a Hugging Face directory instead
(SmolLM2-135M after `make real-model`).

Per mode: rollout tokens/s (every rollout worker's generated tokens over the window from the first
training step to the end), the pause per version (the workers' `swap_pause_s_total / swaps`, from their
heartbeat stats in `earl-stream status --json`), the mean reply length, tokens re-prefilled per swap, the
staleness of trained samples (the trainer's `earl_trainer_staleness_versions` histogram: versions between
a sample's oldest token and the trained policy) and the too-stale token fraction the trainer masked (its
log), and the learning curve (the supervisor's mean reward over its window, per poll).
The `split` key (step-
wise samples, `rollout.non_append`: the summarising agent's episodes kept under `split`, dropped under
`refuse`) comes from `bench/split_episodes.py`'s `run_split` (`--split-episodes N`, 0 skips), or from a
results file it wrote (`--split-from FILE`, its provenance kept with it).

`engine_only` (each mode's repeats; `engine`: their rates and ratios) isolates the swap itself
(`--engine-seconds` per run, 0 = skip): one built-in engine behind the rollout worker's batcher
(`AsyncBatcher`, `weight_swap.swap_weights`), `--inflight` requests always in flight (64-256 new tokens
each, temperature 1, no stop token: the lengths are the drawn ones), a new version published every
`--swap-every-s` seconds on a fixed clock (the weights alternate between the model's and a perturbed copy,
so the copy and refresh are real); the engine loads the newest when its previous load is done, and a drain
that outlasts the period skips the versions published meanwhile (`versions_skipped`). In `up` runs the
rollout workers also wait for the staleness bound (a prompt is played only with weights at least
`step - max_staleness` new), which can hide the swap's cost behind the trainer's pace; the engine figures
do not have that wait.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from earl_stream.env import StepResult

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("drain", "interrupt", "inplace")
MASKED_LINE = re.compile(r"step (\d+): .*masked ([\d.]+) \(stale ([\d.]+)\)")


class LongReply:
    """One turn: reply with up to 64-256 tokens (per seed); reward = the share of digits in the reply."""

    system_prompt = "Write digits."

    def __init__(self) -> None:
        self.max_turn_tokens = 256

    async def reset(self, seed: int) -> str:
        self.max_turn_tokens = random.Random(seed).randint(64, 256)
        return "Write as many digits as you can."

    async def step(self, action_text: str) -> StepResult:
        text = action_text.strip()
        digits = sum(c.isdigit() for c in text)
        return StepResult("", digits / max(1, len(text)), True, {"outcome": "done"})


def run_mode(mode: str, minutes: float, model: str | None, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from pipeline_rates import watch_up

    run_dir = work / mode
    overrides = [f"run_dir={run_dir}", "seed=0", "rollout.workers=2", "trainer.nproc=1", f"rollout.weight_swap={mode}",
                 "supervisor.heartbeat_s=0.25", "trainer.group_size=4", "trainer.groups_per_step=4",
                 "rollout.groups_in_flight=4", "trainer.lr=1e-4", "algo.entropy_coef=0",
                 "algo.lr_schedule=constant", "selector.enabled=false",
                 f"envs.0.spec={HERE / 'weight_swap.py'}:LongReply", "envs.0.name=long_reply",
                 "envs.0.group_seed=per_episode"]
    overrides += [f"model.path={model}"] if model else ["model.warm_start_steps=0"]
    seconds = minutes * 60
    watch = watch_up(overrides, run_dir, lambda now, first: first is not None and now.t - first.t >= seconds,
                     what=mode, poll_s=2.0)
    return {"mode": mode, **summarize(mode, watch, run_dir)}


def _rollout(status: dict[str, Any]) -> list[dict[str, float]]:
    return [w.get("stats", {}) for w in status.get("workers", []) if w.get("role") == "rollout"]


def summarize(mode: str, watch: Any, run_dir: Path) -> dict[str, Any]:
    first, last = watch.first, watch.snapshots[-1]
    if first is None:
        raise SystemExit(f"{mode}: no training step was seen; see {run_dir}/logs")
    tokens = [sum(s.get("tokens", 0) for s in _rollout(snap.status)) for snap in (first, last)]
    workers = _rollout(last.status)
    episodes = sum(s.get("episodes", 0) for s in workers)
    swaps = sum(s.get("swaps", 0) for s in workers)
    pause = sum(s.get("swap_pause_s_total", 0.0) for s in workers)
    reprefill = sum(s.get("swap_reprefill_tokens_total", 0) for s in workers)
    curve = [{"t_s": round(s.t - first.t, 1), "step": s.step, "mean_reward": s.status.get("mean_reward_last")}
             for s in watch.snapshots if s.t >= first.t]
    return {
        "rollout_tokens_per_s": round((tokens[1] - tokens[0]) / max(1e-9, last.t - first.t), 1),
        "pause_seconds_per_version": round(pause / swaps, 4) if swaps else None,
        "mean_reply_tokens": round(sum(s.get("tokens", 0) for s in workers) / max(1, episodes), 1),
        "reprefill_tokens_per_swap": round(reprefill / swaps, 1) if swaps else None,
        "swaps": swaps, "steps": last.step - first.step, "window_s": round(last.t - first.t, 1),
        "episodes": episodes, "swap_failures": sum(s.get("swap_failures", 0) for s in workers),
        "staleness_of_trained_samples": _staleness(last.status),
        "stale_token_fraction_masked": _masked(run_dir),
        "learning_curve": curve,
        "final_mean_reward": curve[-1]["mean_reward"] if curve else None,
    }


def _staleness(status: dict[str, Any]) -> dict[str, float]:
    """The trainer's `earl_trainer_staleness_versions` histogram (cumulative buckets -> per bucket counts)."""
    for w in status.get("workers", []):
        if w.get("role") != "trainer" or not w.get("metrics_address"):
            continue
        try:
            text = urllib.request.urlopen(f"http://{w['metrics_address']}/metrics", timeout=5).read().decode()
        except OSError:
            return {}
        cum = {float(m.group(1)): float(m.group(2)) for m in re.finditer(
            r'earl_trainer_staleness_versions_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)', text)}
        out, below = {}, 0.0
        for le in sorted(cum):
            out[f"<={le:g}"] = cum[le] - below
            below = cum[le]
        return out
    return {}


def _masked(run_dir: Path) -> float | None:
    """Mean too-stale token fraction per step, from the trainer's log."""
    fracs = [float(m.group(3)) for log in (run_dir / "logs").glob("trainer*") for line in log.read_text().splitlines()
             if (m := MASKED_LINE.search(line))]
    return round(sum(fracs) / len(fracs), 5) if fracs else None


def engine_mode(mode: str, model_dir: Path, seconds: float, inflight: int, swap_every_s: float) -> dict[str, Any]:
    """One engine under a steady load of 64-256-token requests, swapping weights every `swap_every_s`."""
    import asyncio
    import time

    import torch

    from earl_stream.model import load_model
    from earl_stream.workers.engines import AsyncBatcher, GenerateRequest, TorchEngine
    from earl_stream.workers.engines.weight_swap import SwapMode, SwapTally, swap_weights

    torch.manual_seed(0)
    model, _ = load_model(model_dir)
    states = [{k: v.clone() for k, v in model.state_dict().items()},
              {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}]
    engine = TorchEngine(model.eval(), weight_swap=mode, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 48))] for _ in range(64)]

    async def go() -> dict[str, Any]:
        batcher, tally = AsyncBatcher(engine), SwapTally(mode)
        done = {"tokens": 0, "replies": 0}
        start = time.monotonic()
        end = start + seconds

        async def client(i: int) -> None:
            while time.monotonic() < end:
                req = GenerateRequest(prompts[(i * 7 + done["replies"]) % 64], rng.randint(64, 256), temperature=1.0)
                res = await batcher.generate(req)
                done["tokens"] += len(res.token_ids)
                done["replies"] += 1

        skipped: dict[str, float] = {"versions": 0, "call_s": 0.0}

        async def trainer() -> None:
            # versions are published on a fixed clock, as a trainer does whatever the engine's swaps take; the
            # engine loads the newest one when its previous load is done (a drain that outlasts the period skips
            # the versions published meanwhile, as a rollout worker does)
            version = 0
            while True:
                due = start + (version + 1) * swap_every_s
                if due >= end:
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                newest = int((time.monotonic() - start) // swap_every_s)
                skipped["versions"] += max(0, newest - version - 1)
                version = max(version + 1, newest)
                began = time.monotonic()
                await swap_weights(batcher, engine, states[version % 2], version, SwapMode(mode), tally)
                skipped["call_s"] += time.monotonic() - began

        await asyncio.gather(trainer(), *[client(i) for i in range(inflight)])
        wall = time.monotonic() - start
        await batcher.aclose()
        return {"mode": mode, "rollout_tokens_per_s": round(done["tokens"] / wall, 1),
                "pause_seconds_per_version": round(tally.pause_s_total / max(1, tally.swaps), 4),
                "mean_reply_tokens": round(done["tokens"] / max(1, done["replies"]), 1),
                "reprefill_tokens_per_swap": round(tally.reprefill_tokens_total / max(1, tally.swaps), 1),
                "swaps": tally.swaps, "versions_skipped": skipped["versions"],
                # a load from its call to its return: the checks and copy, and a drain's wait for running rows
                "swap_call_s_per_version": round(skipped["call_s"] / max(1, tally.swaps), 4), "wall_s": round(wall, 1)}

    return asyncio.run(go())


def split_part(split_from: str, episodes: int) -> dict[str, Any] | None:
    """The `split` key: bench/split_episodes.py's figures, from its results file or a run of `run_split`."""
    if split_from:
        import json

        found = json.loads(Path(split_from).read_text())
        keep = ("episodes_kept", "episodes_dropped_refuse", "episodes", "samples_split", "segments_split", "model",
                "agent", "provenance")
        return {k: found[k] for k in keep if k in found} | {"from": Path(split_from).name}
    if episodes <= 0:
        return None
    sys.path.insert(0, str(HERE))
    from split_episodes import run_split

    found = run_split(episodes=episodes)
    return {k: found[k] for k in ("episodes_kept", "episodes_dropped_refuse", "episodes", "samples_split",
                                  "segments_split", "model", "agent") if k in found}


def _rates(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: rollout tokens/s, mean and 95% interval over its repeats; and each mode over drain (ratio of means).
    ValueError when a mode's runs ran drain's configuration (identical arms are no comparison)."""
    from stats import mean_ci95, ratio_ci95

    for mode, rs in runs.items():
        if mode != "drain" and any(r.get("mode", mode) == "drain" for r in rs):
            raise ValueError(f"the {mode} arm holds runs of drain's configuration: not a comparison")
    rates = {m: [r["rollout_tokens_per_s"] for r in rs] for m, rs in runs.items() if rs}
    if any(len(v) < 2 for v in rates.values()):  # one repeat (a check run): means only, no intervals
        out: dict[str, Any] = {"tokens_per_s": {m: {"mean": statistics.fmean(v), "n": len(v)} for m, v in rates.items()}}
        if "drain" in rates:
            out["speedup_vs_drain"] = {m: {"ratio": statistics.fmean(v) / statistics.fmean(rates["drain"])}
                                       for m, v in rates.items() if m != "drain"}
        return out
    out = {"tokens_per_s": {m: mean_ci95(v) for m, v in rates.items()}}
    if "drain" in rates:
        out["speedup_vs_drain"] = {m: ratio_ci95(v, rates["drain"]) for m, v in rates.items() if m != "drain"}
    return out


def summarise(pipeline: dict[str, list[dict[str, Any]]], engine: dict[str, list[dict[str, Any]]],
              default_mode: str) -> dict[str, Any]:
    """The benchmark's figures from its recorded runs (per mode, each repeat's figures, with the `mode` it ran):
    rates with intervals, ratios over drain, and `default_vs_drain` (None when the default is drain itself)."""
    piped, engined = _rates(pipeline), _rates(engine)
    return {"modes": pipeline, "pipeline": piped, "default_mode": default_mode,
            "default_vs_drain": (piped.get("speedup_vs_drain", {}).get(default_mode)
                                 if default_mode != "drain" else None),
            "engine_only": engine, "engine": engined}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=2.0, help="measured minutes per `up` run (0 skips the pipeline)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved (drain, interrupt, inplace, ...)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--model", default=None, help="a Hugging Face model directory (default: the embedded model)")
    ap.add_argument("--json", default=str(HERE / "results" / "weight_swap.json"))
    ap.add_argument("--engine-seconds", type=float, default=60.0, help="seconds per engine-only run (0 skips them)")
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--swap-every-s", type=float, default=2.0)
    ap.add_argument("--split-episodes", type=int, default=16, help="summarising-agent episodes per setting (0 skips)")
    ap.add_argument("--split-from", default="", help="take `split` from this bench/split_episodes.py results file")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    sys.path.insert(0, str(HERE))
    from earl_stream.config import RolloutConfig

    modes_list = args.modes.split(",")
    default_mode = RolloutConfig(engine="torch").swap_mode  # what rollout.weight_swap=auto runs on the built-in engine
    engine: dict[str, list[dict[str, Any]]] = {m: [] for m in modes_list}
    pipeline: dict[str, list[dict[str, Any]]] = {m: [] for m in modes_list}
    if args.engine_seconds > 0:
        import torch

        from earl_stream.model import ensure_default_model

        torch.set_num_threads(1)
        model_dir = Path(args.model) if args.model else ensure_default_model(warm_start_steps=0)
        for rep in range(args.repeats):
            for mode in modes_list:
                engine[mode].append(engine_mode(mode, model_dir, args.engine_seconds, args.inflight, args.swap_every_s))
                print(f"engine {rep} {mode:10s} {engine[mode][-1]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="earl-weight-swap-") as tmp:
        for rep in range(args.repeats if args.minutes > 0 else 0):
            for mode in modes_list:
                r = run_mode(mode, args.minutes, args.model, Path(tmp) / f"r{rep}")
                pipeline[mode].append(r)
                print(f"up {rep} {mode:10s} {r['rollout_tokens_per_s']:8.1f} tok/s  pause/version "
                      f"{r['pause_seconds_per_version']}s  reply {r['mean_reply_tokens']} tokens  "
                      f"reward {r['final_mean_reward']}", flush=True)
    figures = summarise(pipeline, engine, default_mode)
    result = {
        "model": args.model or "embedded (no warm start)", "minutes_per_mode": args.minutes, "repeats": args.repeats,
        "order": "interleaved: " + ", ".join(modes_list) + ", then again",
        "setup": "earl-stream up: 2 rollout workers, 1 trainer, built-in engine, LongReply (replies of 64-256 tokens), "
                 "group_size 4, groups_per_step 4, max_staleness 1 (default)",
        **figures,
        "engine": {"inflight": args.inflight, "swap_every_s": args.swap_every_s,
                   "seconds_per_mode": args.engine_seconds, **figures["engine"]},
        "split": split_part(args.split_from, args.split_episodes),
    }
    from provenance import write_result

    path = write_result(args.json, result, depends_on=["earl_stream/workers/engines", "earl_stream/workers/rollout.py",
                                                       "bench/weight_swap.py"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
