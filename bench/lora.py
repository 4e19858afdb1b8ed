"""LoRA against the full fine-tune (and TRL's GRPOTrainer + peft): held-out gain, trained tokens/s, weight-sync
bytes and seconds per version, the trainer's peak memory (issue 33's benchmark).

    python bench/lora.py --json bench/results/lora.json [--minutes 60] [--problems 200] [--quick]
    python bench/lora.py --systems trl_lora ...   # rerun some systems; the others' entries are kept from --json

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
- learning, same budget (`--minutes`, default 60, start-up included) per system, from the same imported
  checkpoint: `earl-stream up` on configs/smollm2_arithmetic.yaml (`full`) and on
  configs/smollm2_arithmetic_lora.yaml (`lora`, rank 16), both through bench/real_model.py's `train`; and TRL's
  GRPOTrainer with `peft_config` (`trl_lora`, bench/lora_trl.py, in .venv-bench). Held-out success before and
  after: bench/real_model.py's `held_out` (bench/heldout.py: greedy, the built-in engine, `--problems` questions
  the training set never poses, exact check); `before` is one evaluation of the imported checkpoint, shared by
  the three; `after` evaluates the full run's last checkpoint, the LoRA run's merged export
  (`earl-stream model export --merge`'s `export_model`) and TRL's merged adapter. Trained tokens/s: prompt +
  completion tokens of the trained samples per second, over the steps after the first (earl_stream: the trainer
  log's step lines; TRL: its `num_tokens`; earl_stream's dynamic sampling trains only groups with unequal
  rewards, TRL trains every sample). `gain_ratio` = LoRA's held-out gain / the full fine-tune's (null, with a
  note, when the full fine-tune gained nothing; a note, too, when its gain is within noise).

The model: SmolLM2-135M-Instruct where `make real-model` imported it, else the embedded tiny model.
"""

from __future__ import annotations

import argparse
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

log = logging.getLogger("bench.lora")
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"full": ROOT / "configs" / "smollm2_arithmetic.yaml", "lora": ROOT / "configs" / "smollm2_arithmetic_lora.yaml"}
SYSTEMS = ("full", "lora", "trl_lora")
RANK, ALPHA = 16, 32.0
# the learning runs measure the whole pipeline (`earl-stream up`), the sync and peak parts these modules
DEPENDS_ON = ["earl_stream", "bench/lora.py", "bench/lora_trl.py", "bench/real_model.py", "bench/heldout.py",
              "bench/pipeline_rates.py", "configs/smollm2_arithmetic.yaml", "configs/smollm2_arithmetic_lora.yaml"]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model_dir(given: str) -> str:
    if given:
        return given
    from earl_stream.model import cache_dir, ensure_default_model

    smol = cache_dir() / "models" / "smollm2-135m-instruct"
    return str(smol) if (smol / "config.json").is_file() else str(ensure_default_model())


def _spec() -> Any:
    from earl_stream.model.lora import LoraSpec

    return LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS)


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
    plan = TrainPlan(micro_batch=1, seq_len=seq_len,
                     lora_params=shape.lora_params(RANK, TARGETS) if kind == "lora" else 0)
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


def learn_earl(kind: str, model_dir: str, minutes: float, problems: int, work: Path) -> dict[str, Any]:
    """`earl-stream up` on CONFIGS[kind] for `minutes` (bench/real_model.py's `train`), then held-out after."""
    _bench_path()
    from pipeline_rates import trainer_steps
    from real_model import held_out, train

    from earl_stream.model.export import export_model
    from earl_stream.workers.checkpoint import latest_checkpoint

    run_dir = work / f"{kind}_run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: nothing to resume from
    budget = argparse.Namespace(steps=0, minutes=minutes, every=30.0, overrides=[])
    curve, status, wall = train(Path(model_dir), run_dir, budget, CONFIGS[kind])
    steps = trainer_steps(run_dir / "logs" / "trainer.log")
    numbers = sorted(steps)
    window = steps[numbers[-1]].when - steps[numbers[0]].when if len(numbers) > 1 else 0.0
    tokens = sum(steps[n].tokens for n in numbers[1:])
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"{run_dir} wrote no checkpoint: nothing to evaluate; see {run_dir}/logs")
    if kind == "lora":  # what `earl-stream model export RUN_DIR OUT --merge` writes
        merged = export_model(run_dir, work / "lora_merged", merge=True, overwrite=True)
        after = held_out(merged, problems)
    else:
        after = held_out(Path(model_dir), problems, ckpt)
    return {"heldout_after": after.success, "heldout_after_stderr": after.stderr,
            "trained_tokens_per_s": tokens / window if window else None,
            "config": str(CONFIGS[kind].relative_to(ROOT)), "minutes": round(wall / 60, 2), "steps": len(numbers),
            "samples_trained": sum(s.samples for s in steps.values()), "checkpoint": str(ckpt),
            "heldout_after_detail": _heldout(after), "curve": curve,
            "status": {k: status.get(k) for k in ("policy_version", "samples_produced", "samples_consumed",
                                                  "tokens_produced", "wall_seconds")}}


def learn_trl(model_dir: str, minutes: float, problems: int, work: Path, threads: int) -> dict[str, Any]:
    """TRL's GRPOTrainer + peft_config for `minutes` (bench/lora_trl.py), then held-out after on its merged model."""
    _bench_path()
    from lora_trl import run_trl
    from real_model import held_out

    trl_work = work / "trl_run"
    shutil.rmtree(trl_work, ignore_errors=True)
    trl_work.mkdir(parents=True)
    run = run_trl(model_dir, minutes, trl_work, threads)
    after = held_out(Path(run["merged"]), problems)
    shutil.rmtree(run["merged"], ignore_errors=True)  # 540 MB: the numbers are what is kept
    return {"heldout_after": after.success, "heldout_after_stderr": after.stderr,
            "trained_tokens_per_s": run.pop("trained_tokens_per_s"), "minutes": round(run["wall_seconds"] / 60, 2),
            **run, "heldout_after_detail": _heldout(after)}


def ratios(result: dict[str, Any]) -> list[str]:
    """sync_bytes_ratio, sync_seconds_ratio (full over LoRA), each system's held-out gain (and its standard error,
    before and after taken as independent: an upper bound) and gain_ratio (LoRA's gain over the full one's: null
    when the full fine-tune gained nothing). Returns notes on what the gains can and cannot say."""
    full, lora = result["full"], result["lora"]
    result["sync_bytes_ratio"] = full["sync_bytes_per_version"] / lora["sync_bytes_per_version"]
    result["sync_seconds_ratio"] = full["sync_seconds_per_version"] / lora["sync_seconds_per_version"]
    ran = [k for k in SYSTEMS if result.get(k, {}).get("heldout_after") is not None]
    gains = {k: result[k]["heldout_after"] - result[k]["heldout_before"] for k in ran}
    result["heldout_gain"] = gains
    result["heldout_gain_stderr"] = {k: (result[k]["heldout_before_stderr"] ** 2 + result[k]["heldout_after_stderr"] ** 2)
                                     ** 0.5 for k in ran}
    full_gain = gains.get("full")
    result["gain_ratio"] = gains["lora"] / full_gain if full_gain is not None and full_gain > 0 and "lora" in gains else None
    notes = []
    if full_gain is not None and full_gain <= 0:
        notes.append(f"gain_ratio is null: the full fine-tune gained {full_gain:+.3f} on the held-out set in its "
                     "budget, so LoRA's gain over it is meaningless")
    elif full_gain is not None and full_gain < 2 * result["heldout_gain_stderr"]["full"]:
        notes.append(f"the full fine-tune's held-out gain ({full_gain:+.3f} +- {result['heldout_gain_stderr']['full']:.3f}) "
                     "is within two standard errors of zero: gain_ratio is not meaningful at this budget")
    return notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench/results/lora.json")
    ap.add_argument("--model", default="", help="model directory (default: SmolLM2 if imported, else the tiny one)")
    ap.add_argument("--minutes", type=float, default=60.0, help="training budget per system, start-up included")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems (>= 200 for the reported number)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="learning runs to do (full,lora,trl_lora; empty: none); the others' entries are kept from --json")
    ap.add_argument("--trl-threads", type=int, default=1,
                    help="TRL's torch threads (as bench/e2e.py: on this shared machine 2 threads ran slower than 1)")
    ap.add_argument("--quick", action="store_true", help="3 minutes per system, 24 problems, fewer versions, a "
                    "shorter micro-batch: checks the pipeline, not the goals")
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
        args.minutes, args.problems = min(args.minutes, 3.0), min(args.problems, 24)
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(unknown)}; known: {','.join(SYSTEMS)}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.exists() else {}
    result: dict[str, Any] = {"model": model_dir, "peak_seq_len": seq_len, "quick": args.quick,
                              "lora_spec": {"rank": RANK, "alpha": ALPHA, "targets": list(TARGETS)},
                              "minutes_per_system": args.minutes, "problems": args.problems}
    load_before = os.getloadavg()
    synced = sync(model_dir, 2 if args.quick else 5)
    for kind in ("full", "lora"):
        result[kind] = {**{k: v for k, v in old.get(kind, {}).items() if kind not in systems},
                        **_peak_in_subprocess(kind, model_dir, seq_len), **synced[kind]}
    result["trl_lora"] = {} if "trl_lora" in systems else dict(old.get("trl_lora", {}))
    work = out.parent / "lora_run"
    if systems:
        before = heldout_before(model_dir, args.problems)
        log.info("held-out before: %.3f +- %.3f (%d problems)", before["success"], before["stderr"], before["problems"])
    for kind in systems:
        log.info("%s: training for %.0f minutes ...", kind, args.minutes)
        learned = (learn_trl(model_dir, args.minutes, args.problems, work, args.trl_threads) if kind == "trl_lora"
                   else learn_earl(kind, model_dir, args.minutes, args.problems, work))
        result[kind].update({"heldout_before": before["success"], "heldout_before_stderr": before["stderr"],
                             "heldout_before_detail": before, **learned})
        log.info("%s: held-out %.3f -> %.3f, %.1f trained tokens/s", kind, before["success"],
                 learned["heldout_after"], learned["trained_tokens_per_s"] or 0.0)
        result["notes"] = ratios(result)
        write_result(out, result, indent=2, depends_on=DEPENDS_ON)  # kept should a later system fail
    result["machine"] = {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                         "note": "shared machine: other sessions' runs and tests ran alongside (see the load)"}
    result["notes"] = ratios(result) + (
        ["heldout_before is one greedy evaluation of the imported checkpoint, shared by the systems (they all start "
         "from it)"] if any(result[k].get("heldout_before") is not None for k in SYSTEMS) else [])
    write_result(out, result, indent=2, depends_on=DEPENDS_ON)
    print_table(result)
    return 0


def print_table(result: dict[str, Any]) -> None:
    print(f"{'':9} {'bytes/version':>14} {'sync s':>8} {'peak MB meas':>13} {'peak MB pred':>13} {'held-out':>14} "
          f"{'train tok/s':>11}")
    for kind in SYSTEMS:
        r = result.get(kind, {})
        sync_cols = (f"{r['sync_bytes_per_version']:>14,} {r['sync_seconds_per_version']:>8.3f} "
                     f"{r['peak_bytes_measured'] / 2**20:>13.0f} {r['peak_bytes_predicted'] / 2**20:>13.0f}"
                     if "sync_bytes_per_version" in r else f"{'':>14} {'':>8} {'':>13} {'':>13}")
        held = (f"{r['heldout_before']:.3f}->{r['heldout_after']:.3f}" if r.get("heldout_after") is not None
                else "not run")
        tok = r.get("trained_tokens_per_s")
        print(f"{kind:9} {sync_cols} {held:>14} {f'{tok:.1f}' if tok else '-':>11}")
    print(f"sync bytes ratio {result['sync_bytes_ratio']:.1f}x, seconds ratio {result['sync_seconds_ratio']:.1f}x, "
          f"gain ratio {result['gain_ratio']}")


if __name__ == "__main__":
    raise SystemExit(main())
