"""LoRA against the full fine-tune (and TRL's GRPOTrainer + peft): held-out gain over seeds, weight-sync bytes and
seconds per version, the trainer's peak memory.

    python bench/lora.py --json bench/results/lora.json [--steps 12] [--seeds 3] [--trl-seeds 1] [--problems 200]
    python bench/lora.py --resume ...    # keep the runs --json already holds, run only the missing ones
    python bench/lora.py --quick ...     # 2 steps, 1 seed, 24 problems: checks the pipeline, not the goals

Measured here:
- sync per version, both ways: the trainer side's `publish_weights` of what a version holds (the whole
  state dict, or `model.lora.adapter_state`: the adapters alone) into a `ShardNode`, a `ShardClient`'s
  `pull_weights` of it, and the built-in engine's `load_state_dict` (a LoRA version is applied unmerged: the
  base untouched, B (A x) added in the forward). Medians over the versions; one process, loopback. The sync
  alone, interleaved and with intervals, at rank 1 and 16: bench/lora_sync.py.
- the trainer's peak per rank for a micro-batch (forward, backward, AdamW step; two steps) in a fresh process:
  measured as peak RSS (VmHWM) minus RSS before the model was loaded (CPU), against `memory_model`'s
  prediction for the same plan. The weights are copied out of their memory-mapped safetensors first (so
  that all of them are resident, as the model assumes) and the high-water mark is reset after that copy;
  freed blocks go back to the OS (glibc's mmap threshold at 64 KiB, as `trainer.malloc_mmap_threshold`).
- learning: `--steps` trainer steps per run (not a time budget: the machine is shared, and a step is the same
  work on either side), `--seeds` seeds per arm (the config's `seed`: sampling, shuffling), the arms
  interleaved (`run_order`: seed 0 full then LoRA, seed 1 LoRA then full, ...), from the same imported
  checkpoint: `earl-stream up` on configs/smollm2_arithmetic.yaml (`full`) and on
  configs/smollm2_arithmetic_lora.yaml (`lora`: its `model.lora`, rank 1 at 10x the learning rate), both
  through bench/real_model.py's `train`; and TRL's GRPOTrainer with `peft_config` (`trl_lora`,
  bench/lora_trl.py, in .venv-bench; `--trl-seeds`, same steps). Held-out success before and after:
  bench/real_model.py's `held_out` (bench/heldout.py: greedy, the built-in engine, `--problems` questions the
  training set never poses, exact check); `before` is one evaluation of the imported checkpoint, shared by
  every run (greedy: the same for all); `after` evaluates the full run's last checkpoint, the LoRA run's merged
  export (`earl-stream model export --merge`'s `export_model`) and TRL's merged adapter. A run's gain is after
  minus before; per arm the mean gain with its 95% interval over seeds; `gain_ratio` = LoRA's mean gain over
  the full fine-tune's, with a 95% interval (bench/stats.ratio_of_means_ci95). Trained tokens/s: prompt +
  completion tokens of the trained samples per second, over the steps after the first.

The model: SmolLM2-135M-Instruct where `make real-model` imported it, else the embedded tiny model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402
from bench.stats import mean_ci95, ratio_of_means_ci95  # noqa: E402

log = logging.getLogger("bench.lora")
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"full": ROOT / "configs" / "smollm2_arithmetic.yaml", "lora": ROOT / "configs" / "smollm2_arithmetic_lora.yaml"}
SYSTEMS = ("full", "lora", "trl_lora")
# the learning runs measure the whole pipeline (`earl-stream up`), the sync and peak parts these modules
DEPENDS_ON = ["earl_stream", "bench/lora.py", "bench/lora_trl.py", "bench/real_model.py", "bench/heldout.py",
              "bench/pipeline_rates.py", "configs/smollm2_arithmetic.yaml", "configs/smollm2_arithmetic_lora.yaml"]


def _model_dir(given: str) -> str:
    if given:
        return given
    from earl_stream.model import cache_dir, ensure_default_model

    smol = cache_dir() / "models" / "smollm2-135m-instruct"
    return str(smol) if (smol / "config.json").is_file() else str(ensure_default_model())


def _spec() -> Any:
    """The LoRA run's adapters, as configs/smollm2_arithmetic_lora.yaml sets them (the sync and peak parts
    measure what the learning runs train)."""
    import yaml

    from earl_stream.model.lora import LoraSpec

    lora = yaml.safe_load(CONFIGS["lora"].read_text())["model"]["lora"]
    return LoraSpec(rank=int(lora["rank"]), alpha=float(lora["alpha"]), target_modules=tuple(lora["target_modules"]))


def sync(model_dir: str, versions: int) -> dict[str, dict[str, float]]:
    """Bytes and seconds (publish, pull, engine load) per version, full and LoRA."""
    import torch

    from earl_stream.model import load_model
    from earl_stream.model.lora import adapter_state, apply_lora, state_bytes
    from earl_stream.store import ShardClient, ShardNode
    from earl_stream.store.weights import drop_weights, publish_weights, pull_weights
    from earl_stream.workers.engines.torch_engine import TorchEngine

    engine = TorchEngine(load_model(model_dir)[0].eval(), seed=0)
    out: dict[str, dict[str, float]] = {}
    with ShardNode() as node, ShardClient(timeout_s=300.0) as client:
        for kind in ("full", "lora"):
            model, _ = load_model(model_dir)
            if kind == "lora":
                apply_lora(model, _spec())
            times: dict[str, list[float]] = {"publish": [], "pull": [], "load": []}
            size = 0
            for v in range(versions):
                version = (1 if kind == "full" else 100) + v
                with torch.no_grad():  # a "trained" version: what changes is what a version holds
                    for p in model.parameters():
                        if p.requires_grad:
                            p.add_(1e-4)
                t0 = time.perf_counter()
                state = adapter_state(model) if kind == "lora" else model.state_dict()
                publish_weights(node, version, state)
                t1 = time.perf_counter()
                pulled = pull_weights(client, node.address, version, timeout_s=300.0)
                t2 = time.perf_counter()
                engine.load_state_dict(pulled, version)
                t3 = time.perf_counter()
                size = state_bytes(pulled)
                for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[key].append(seconds)
                drop_weights(node, version)
            med = {k: statistics.median(v) for k, v in times.items()}
            out[kind] = {"sync_bytes_per_version": size, "sync_seconds_per_version": sum(med.values()),
                         **{f"{k}_seconds": s for k, s in med.items()}}
            log.info("%s: %d bytes per version, publish %.3fs pull %.3fs engine load %.3fs", kind, size,
                     med["publish"], med["pull"], med["load"])
            del model
    return out


def peak(kind: str, model_dir: str, seq_len: int) -> dict[str, float]:
    """One micro-batch (1 x seq_len) forward + backward + AdamW step in this process: peak bytes over the
    RSS before the model was loaded, and the memory model's prediction for it."""
    import torch

    from earl_stream.model import load_model
    from earl_stream.model.lora import apply_lora
    from earl_stream.supervisor.memory_model import ModelShape, TrainPlan, predict_train_memory
    from earl_stream.workers.host_memory import set_malloc_mmap_threshold

    torch.set_num_threads(1)
    set_malloc_mmap_threshold(65536)  # freed blocks go back to the OS: RSS follows live tensors (trainer.malloc_mmap_threshold)
    before = _rss_bytes()
    model, _ = load_model(model_dir)
    with torch.no_grad():  # resident copies: memory-mapped weights would count only where read (and be evictable)
        for p in model.parameters():
            p.data = p.data.clone()
    _reset_peak()  # the copy above held file pages and their copy at once: not the step's peak
    if kind == "lora":
        apply_lora(model, _spec())
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(5, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second step is the steady state: AdamW's state exists from the first on
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # as train_step does
    measured = _hwm_bytes() - before
    shape = ModelShape.from_hf(model.config)
    spec = _spec()
    plan = TrainPlan(micro_batch=1, seq_len=seq_len,
                     lora_params=shape.lora_params(spec.rank, spec.target_modules) if kind == "lora" else 0)
    return {"peak_bytes_measured": measured, "peak_bytes_predicted": predict_train_memory(shape, plan).total_bytes}


def _hwm_bytes() -> int:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent across fork + exec)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: `5` into /proc/self/clear_refs)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_in_subprocess(kind: str, model_dir: str, seq_len: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--peak", kind, "--model", model_dir, "--seq-len", str(seq_len)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------------------------- learning

def _bench_path() -> None:
    here = str(Path(__file__).resolve().parent)  # bench/real_model.py imports its siblings by bare name
    if here not in sys.path:
        sys.path.insert(0, here)


def _heldout(result: Any) -> dict[str, Any]:
    return {"success": result.success, "stderr": result.stderr, "problems": result.problems,
            "outcomes": result.outcomes, "seconds": round(result.seconds, 1)}


def heldout_before(model_dir: str, problems: int) -> dict[str, Any]:
    _bench_path()
    from real_model import held_out

    return _heldout(held_out(Path(model_dir), problems))


def config_digest(kind: str) -> str:
    """What an arm runs, as text: its config file, or TRL's name (two arms with one digest are one configuration)."""
    if kind not in CONFIGS:
        return f"trl GRPOTrainer + peft on {CONFIGS['lora'].name}"
    return hashlib.sha256(CONFIGS[kind].read_bytes()).hexdigest()[:16]


def learn_earl(kind: str, model_dir: str, steps: int, seed: int, problems: int, work: Path) -> dict[str, Any]:
    """`earl-stream up --steps N seed=S` on CONFIGS[kind] (bench/real_model.py's `train`), then held-out after."""
    _bench_path()
    from pipeline_rates import trainer_steps
    from real_model import held_out, train

    from earl_stream.model.export import export_model
    from earl_stream.workers.checkpoint import latest_checkpoint

    run_dir = work / f"{kind}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: nothing to resume from
    budget = argparse.Namespace(steps=steps, minutes=0.0, every=30.0, overrides=[f"seed={seed}"])
    curve, status, wall = train(Path(model_dir), run_dir, budget, CONFIGS[kind])
    logged = trainer_steps(run_dir / "logs" / "trainer.log")
    numbers = sorted(logged)
    window = logged[numbers[-1]].when - logged[numbers[0]].when if len(numbers) > 1 else 0.0
    tokens = sum(logged[n].tokens for n in numbers[1:])
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"{run_dir} wrote no checkpoint: nothing to evaluate; see {run_dir}/logs")
    if kind == "lora":  # what `earl-stream model export RUN_DIR OUT --merge` writes
        merged = export_model(run_dir, work / "lora_merged", merge=True, overwrite=True)
        after = held_out(merged, problems)
        shutil.rmtree(merged, ignore_errors=True)
    else:
        after = held_out(Path(model_dir), problems, ckpt)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~1.6 GB a run: the numbers are what is kept
    return {"seed": seed, "steps": len(numbers), "heldout_after": after.success, "heldout_after_stderr": after.stderr,
            "trained_tokens_per_s": tokens / window if window else None, "minutes": round(wall / 60, 2),
            "samples_trained": sum(s.samples for s in logged.values()), "config": str(CONFIGS[kind].relative_to(ROOT)),
            "config_digest": config_digest(kind), "heldout_after_detail": _heldout(after), "curve": curve,
            "status": {k: status.get(k) for k in ("policy_version", "samples_produced", "samples_consumed",
                                                  "tokens_produced", "wall_seconds")}}


def learn_trl(model_dir: str, steps: int, seed: int, problems: int, work: Path, threads: int) -> dict[str, Any]:
    """TRL's GRPOTrainer + peft_config for `steps` steps (bench/lora_trl.py), then held-out on its merged model."""
    _bench_path()
    from lora_trl import run_trl
    from real_model import held_out

    trl_work = work / f"trl_seed{seed}"
    shutil.rmtree(trl_work, ignore_errors=True)
    trl_work.mkdir(parents=True)
    run = run_trl(model_dir, trl_work, threads, steps=steps, seed=seed)
    after = held_out(Path(run["merged"]), problems)
    shutil.rmtree(run["merged"], ignore_errors=True)  # 540 MB: the numbers are what is kept
    return {"seed": seed, "heldout_after": after.success, "heldout_after_stderr": after.stderr,
            "minutes": round(run["wall_seconds"] / 60, 2), "config_digest": config_digest("trl_lora"), **run,
            "heldout_after_detail": _heldout(after)}


def run_order(seeds: int, trl_seeds: int, systems: list[str]) -> list[tuple[str, int]]:
    """(system, seed) in the order run: seed by seed, the two earl_stream arms alternating which goes first (a
    drift in the machine's load falls on both), TRL's seeds after the seed's pair."""
    order: list[tuple[str, int]] = []
    for seed in range(seeds):
        pair = [k for k in (("full", "lora") if seed % 2 == 0 else ("lora", "full")) if k in systems]
        order += [(k, seed) for k in pair]
        if "trl_lora" in systems and seed < trl_seeds:
            order.append(("trl_lora", seed))
    return order


def summarise(result: dict[str, Any]) -> list[str]:
    """From the recorded runs: each arm's gains (after - before, per seed), their mean with a 95% interval
    (`gain`; one run: the value and its binomial standard error), the sync ratios, `gain_ratio` (LoRA's mean
    gain over the full one's, with its interval). Refuses arms with one configuration (never a comparison).
    Returns notes on what the numbers can and cannot say."""
    before = result["heldout_before"]
    notes: list[str] = []
    for kind in SYSTEMS:
        arm = result.get(kind) or {}
        runs = arm.get("runs") or []
        gains = [r["heldout_after"] - before["success"] for r in runs]
        arm["gains"] = gains
        if len(gains) >= 2:
            arm["gain"] = mean_ci95(gains)
        elif gains:
            stderr = (before["stderr"] ** 2 + runs[0]["heldout_after_stderr"] ** 2) ** 0.5
            arm["gain"] = {"mean": gains[0], "stderr": stderr, "n": 1}
    digests = {k: {r["config_digest"] for r in (result.get(k) or {}).get("runs", [])} for k in ("full", "lora")}
    if digests["full"] & digests["lora"]:
        raise ValueError("full and lora ran one configuration: their comparison says nothing")
    full, lora = result["full"], result["lora"]
    result["sync_bytes_ratio"] = full["sync_bytes_per_version"] / lora["sync_bytes_per_version"]
    result["sync_seconds_ratio"] = full["sync_seconds_per_version"] / lora["sync_seconds_per_version"]
    result["gain_ratio"] = None
    if len(full.get("gains", [])) >= 2 and len(lora.get("gains", [])) >= 2:
        try:
            result["gain_ratio"] = ratio_of_means_ci95(lora["gains"], full["gains"])
        except ValueError as e:
            notes.append(f"gain_ratio is null: {e}")
        if full["gain"]["low"] <= 0:
            notes.append(f"the full fine-tune's mean gain {full['gain']['mean']:+.3f} has a 95% interval that reaches "
                         f"zero ({full['gain']['low']:+.3f}): gain_ratio's interval is wide and its lower end means little")
    else:
        notes.append("gain_ratio is null: it needs at least 2 seeds of full and of lora")
    return notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench/results/lora.json")
    ap.add_argument("--model", default="", help="model directory (default: SmolLM2 if imported, else the tiny one)")
    ap.add_argument("--steps", type=int, default=12, help="trainer steps per learning run (each arm the same)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per earl_stream arm (full, lora), interleaved")
    ap.add_argument("--trl-seeds", type=int, default=1, help="seeds of TRL + peft (0: none; ~17 min a seed here)")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems (>= 200 for the reported number)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="arms to run (full,lora,trl_lora; empty: none)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs --json holds (same steps and problems) and run only the missing (system, seed)")
    ap.add_argument("--trl-threads", type=int, default=1,
                    help="TRL's torch threads (as bench/e2e.py: on this shared machine 2 threads ran slower than 1)")
    ap.add_argument("--quick", action="store_true", help="2 steps, 1 seed, 24 problems, fewer versions, a shorter "
                    "micro-batch: checks the pipeline, not the goals")
    ap.add_argument("--peak", choices=("full", "lora"), help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_dir = _model_dir(args.model)
    seq_len = args.seq_len or (128 if args.quick else 512)
    if args.peak:
        print(json.dumps(peak(args.peak, model_dir, seq_len)))
        return 0
    from earl_stream.workers.host_memory import set_malloc_mmap_threshold

    set_malloc_mmap_threshold(65536)  # this process loads and frees models: give their memory back to the OS
    if args.quick:
        args.steps, args.seeds, args.trl_seeds, args.problems = 2, 1, min(args.trl_seeds, 1), min(args.problems, 24)
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(unknown)}; known: {','.join(SYSTEMS)}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if args.resume and out.exists() else {}
    if old and (old.get("steps_per_run"), old.get("problems")) != (args.steps, args.problems):
        ap.error(f"--resume: {out} has {old.get('steps_per_run')} steps, {old.get('problems')} problems a run; "
                 f"asked {args.steps}, {args.problems}")
    spec = _spec()
    order = run_order(args.seeds, args.trl_seeds, systems)
    result: dict[str, Any] = {"model": model_dir, "peak_seq_len": seq_len, "quick": args.quick,
                              "lora_spec": {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.target_modules)},
                              "steps_per_run": args.steps, "seeds": args.seeds, "trl_seeds": args.trl_seeds,
                              "problems": args.problems, "run_order": [f"{k}:{s}" for k, s in order]}
    load_before = os.getloadavg()
    synced = sync(model_dir, 2 if args.quick else 5)
    for kind in ("full", "lora"):
        result[kind] = {**_peak_in_subprocess(kind, model_dir, seq_len), **synced[kind]}
    for kind in SYSTEMS:
        result.setdefault(kind, {})["runs"] = list((old.get(kind) or {}).get("runs", []))
    result["heldout_before"] = old.get("heldout_before") or heldout_before(model_dir, args.problems)
    log.info("held-out before: %.3f +- %.3f (%d problems)", result["heldout_before"]["success"],
             result["heldout_before"]["stderr"], result["heldout_before"]["problems"])
    work = out.parent / "lora_run"
    for kind, seed in order:
        if any(r["seed"] == seed for r in result[kind]["runs"]):
            log.info("%s seed %d: kept from %s", kind, seed, out)
            continue
        log.info("%s seed %d: %d steps ...", kind, seed, args.steps)
        run = (learn_trl(model_dir, args.steps, seed, args.problems, work, args.trl_threads) if kind == "trl_lora"
               else learn_earl(kind, model_dir, args.steps, seed, args.problems, work))
        run["load_avg_after"] = os.getloadavg()
        result[kind]["runs"].append(run)
        log.info("%s seed %d: held-out %.3f -> %.3f in %.1f minutes", kind, seed, result["heldout_before"]["success"],
                 run["heldout_after"], run["minutes"])
        result["notes"] = summarise(result)
        write_result(out, result, indent=2, depends_on=DEPENDS_ON)  # kept should a later run fail
    result["machine"] = {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                         "note": "shared machine: other jobs' runs and tests may run alongside (each run's "
                                 "load_avg_after); the learning runs are step-bound, so load changes their minutes, "
                                 "not their work"}
    result["notes"] = summarise(result) + [
        "heldout_before is one greedy evaluation of the imported checkpoint, shared by every run (they all start from it)"]
    write_result(out, result, indent=2, depends_on=DEPENDS_ON)
    print_table(result)
    return 0


def _interval(x: dict[str, Any] | None) -> str:
    if not x:
        return "-"
    if "low" in x:
        return f"{x['mean']:+.3f} [{x['low']:+.3f}, {x['high']:+.3f}]"
    return f"{x['mean']:+.3f} +- {x.get('stderr', 0):.3f}"


def print_table(result: dict[str, Any]) -> None:
    print(f"{'':9} {'bytes/version':>14} {'sync s':>8} {'peak MB meas':>13} {'peak MB pred':>13} "
          f"{'gains per seed':>24} {'mean gain [95%]':>26}")
    for kind in SYSTEMS:
        r = result.get(kind, {})
        sync_cols = (f"{r['sync_bytes_per_version']:>14,} {r['sync_seconds_per_version']:>8.3f} "
                     f"{r['peak_bytes_measured'] / 2**20:>13.0f} {r['peak_bytes_predicted'] / 2**20:>13.0f}"
                     if "sync_bytes_per_version" in r else f"{'':>14} {'':>8} {'':>13} {'':>13}")
        gains = ", ".join(f"{g:+.3f}" for g in r.get("gains", [])) or "not run"
        print(f"{kind:9} {sync_cols} {gains:>24} {_interval(r.get('gain')):>26}")
    print(f"held-out before {result['heldout_before']['success']:.3f}; sync bytes ratio "
          f"{result['sync_bytes_ratio']:.1f}x, seconds ratio {result['sync_seconds_ratio']:.1f}x, gain ratio "
          f"{_interval(result['gain_ratio'])}")


if __name__ == "__main__":
    raise SystemExit(main())
