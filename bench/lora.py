"""LoRA against the full fine-tune: weight-sync bytes and seconds per version, the trainer's peak memory.

    python bench/lora.py --json bench/results/lora.json [--quick] [--model DIR]

Measured here (what this script does today):
- sync per version, both ways: the trainer side's `publish_weights` of what a version holds (the whole
  state dict, or `model.lora.adapter_state`: the adapters alone) into a `ShardNode`, a `ShardClient`'s
  `pull_weights` of it, and the built-in engine's `load_state_dict` (a LoRA version is merged into the
  engine's copy of the base). Medians over the versions; one process, loopback.
- the trainer's peak per rank for a micro-batch (forward, backward, AdamW step; two steps) in a fresh process:
  measured as peak RSS (VmHWM) minus RSS before the model was loaded (CPU), against `memory_model`'s
  prediction for the same plan. The weights are copied out of their memory-mapped safetensors first (so
  that all of them are resident, as the model assumes) and the high-water mark is reset after that copy;
  freed blocks go back to the OS (glibc's mmap threshold at 64 KiB, as `trainer.malloc_mmap_threshold`).

Not measured yet (the JSON holds null for them): held-out success before/after a 60-minute run of each
and trained tokens/s (`bench/real_model.py`'s protocol), and TRL's GRPOTrainer with `peft_config`; so
`gain_ratio` is null too.

The model: SmolLM2-135M-Instruct where `make real-model` imported it, else the embedded tiny model.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402

log = logging.getLogger("bench.lora")
RANK, ALPHA = 16, 32.0
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench/results/lora.json")
    ap.add_argument("--model", default="", help="model directory (default: SmolLM2 if imported, else the tiny one)")
    ap.add_argument("--quick", action="store_true", help="fewer versions, a shorter micro-batch")
    ap.add_argument("--peak", choices=("full", "lora"), help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_dir = _model_dir(args.model)
    seq_len = args.seq_len or (128 if args.quick else 512)
    if args.peak:
        print(json.dumps(peak(args.peak, model_dir, seq_len)))
        return 0
    result: dict[str, Any] = {"model": model_dir, "lora": {"rank": RANK, "alpha": ALPHA, "targets": list(TARGETS)},
                              "peak_seq_len": seq_len}
    synced = sync(model_dir, 2 if args.quick else 5)
    for kind in ("full", "lora"):
        result[kind] = {"heldout_before": None, "heldout_after": None, "trained_tokens_per_s": None,
                        **_peak_in_subprocess(kind, model_dir, seq_len), **synced[kind]}
    result["trl_lora"] = {"heldout_before": None, "heldout_after": None, "trained_tokens_per_s": None}
    full, lora = result["full"], result["lora"]
    result["sync_bytes_ratio"] = full["sync_bytes_per_version"] / lora["sync_bytes_per_version"]
    result["sync_seconds_ratio"] = full["sync_seconds_per_version"] / lora["sync_seconds_per_version"]
    result["gain_ratio"] = None
    result["not_measured"] = ("heldout_*, trained_tokens_per_s, trl_lora and gain_ratio: the 60-minute learning "
                              "runs are not in this script yet")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(args.json), result, indent=2)
    print(f"{'':6} {'bytes/version':>14} {'sync s':>8} {'peak MB meas':>13} {'peak MB pred':>13}")
    for kind in ("full", "lora"):
        r = result[kind]
        print(f"{kind:6} {r['sync_bytes_per_version']:>14,} {r['sync_seconds_per_version']:>8.3f} "
              f"{r['peak_bytes_measured'] / 2**20:>13.0f} {r['peak_bytes_predicted'] / 2**20:>13.0f}")
    print(f"sync bytes ratio {result['sync_bytes_ratio']:.1f}x, seconds ratio {result['sync_seconds_ratio']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
