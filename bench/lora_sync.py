"""Benchmark: what one policy version costs to sync, full weights against a LoRA adapter (rank 1 and 16).

One version = the trainer side's `publish_weights` of what the version holds (the whole state dict, each tensor
once: a tied embedding is not published twice; or `model.lora.adapter_state`, the adapters alone), a
`ShardClient`'s `pull_weights` of it over loopback, and the built-in engine's `load_state_dict` of what was pulled
(full: checked, copied into the live parameters, the fused projections rebuilt; LoRA: checked and applied
unmerged, a pointer swap, `workers.engines.adapters`). Before each version the trainer-side model's trainable
tensors change (all of them, or the adapters), as a training step would. Arms interleaved, their order rotated
every repeat, one untimed version per arm first; every repeat is recorded, each arm's mean with its 95% interval,
and full over LoRA with its interval (`stats.ratio_ci95`). Bytes: the version's manifest total.

The model: SmolLM2-135M-Instruct where `make real-model` imported it, else random weights of its shape (Llama,
30 layers, hidden 576, tied embeddings; fp32). LoRA on q/k/v/o/gate/up/down, alpha = 2 x rank.

    python bench/lora_sync.py [--repeats 5] [--json bench/results/lora_sync.json] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import write_result  # noqa: E402
from stats import mean_ci95, ratio_ci95  # noqa: E402

from earl_stream.progress import progress  # noqa: E402

DEPENDS_ON = ["earl_stream/model/lora.py", "earl_stream/store", "earl_stream/workers/engines", "bench/lora_sync.py",
              "bench/stats.py"]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS = (1, 16)
GOALS = {"sync_bytes_ratio": 50.0, "sync_seconds_ratio": 10.0}  # full over LoRA: the least ratios that meet the goal


def smollm2_shaped(seed: int = 0) -> Any:
    """Random weights in SmolLM2-135M's shape (its config.json's numbers), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.041666)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def base_model(given: str) -> tuple[Any, str]:
    """The model and what it is (a directory, or the shaped random one)."""
    from earl_stream.model import cache_dir, load_model

    smol = Path(given) if given else cache_dir() / "models" / "smollm2-135m-instruct"
    if (smol / "config.json").is_file():
        return load_model(smol)[0].eval(), str(smol)
    return smollm2_shaped(), "random weights, SmolLM2-135M-shaped (make real-model has not imported it here)"


def trainer_side(base: Any, arm: str) -> Any:
    """The trainer's model for `arm`: a copy of the base, with rank-r adapters for a LoRA arm."""
    from earl_stream.model.lora import LoraSpec, apply_lora

    model = copy.deepcopy(base)
    if arm != "full":
        rank = int(arm.removeprefix("lora_r"))
        apply_lora(model, LoraSpec(rank=rank, alpha=2.0 * rank, target_modules=TARGETS))
    return model


def one_version(model: Any, arm: str, version: int, node: Any, client: Any, engine: Any) -> dict[str, float]:
    """A step's worth of change, then publish, pull and apply version `version`; seconds of each and bytes."""
    from earl_stream.model.lora import adapter_state
    from earl_stream.store.weights import drop_weights, publish_weights, pull_weights

    with torch.no_grad():
        for p in model.parameters():
            if arm == "full" or p.requires_grad:
                p.add_(1e-4)
    t0 = time.perf_counter()
    state = model.state_dict() if arm == "full" else adapter_state(model)
    manifest = publish_weights(node, version, state)
    t1 = time.perf_counter()
    pulled = pull_weights(client, node.address, version, timeout_s=300.0)
    t2 = time.perf_counter()
    engine.load_state_dict(pulled, version)
    t3 = time.perf_counter()
    drop_weights(node, version)
    return {"publish_s": t1 - t0, "pull_s": t2 - t1, "apply_s": t3 - t2, "total_s": t3 - t0,
            "bytes": manifest.total_bytes}


def summarise(arms: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per arm: bytes, every repeat, mean and 95% interval of each part (and the median total: one stalled pull on
    a loaded machine moves a LoRA arm's mean); full over each LoRA arm, of the means with their interval (the
    headline) and of the medians."""
    out: dict[str, Any] = {"arms": {}}
    for arm, reps in arms.items():
        out["arms"][arm] = {"bytes_per_version": reps[0]["bytes"], "repeats": reps,
                            **{k: mean_ci95([r[k] for r in reps]) for k in ("total_s", "publish_s", "pull_s", "apply_s")},
                            "total_s_median": statistics.median(r["total_s"] for r in reps)}
    full = arms["full"]
    out["sync_bytes_ratio"] = {f"rank{r}": full[0]["bytes"] / arms[f"lora_r{r}"][0]["bytes"] for r in RANKS}
    out["sync_seconds_ratio"] = {f"rank{r}": ratio_ci95([x["total_s"] for x in full],
                                                        [x["total_s"] for x in arms[f"lora_r{r}"]]) for r in RANKS}
    out["sync_seconds_ratio_of_medians"] = {f"rank{r}": out["arms"]["full"]["total_s_median"]
                                            / out["arms"][f"lora_r{r}"]["total_s_median"] for r in RANKS}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--model", default="", help="model directory (default: SmolLM2 if imported, else random weights "
                    "of its shape)")
    ap.add_argument("--repeats", type=int, default=5, help="timed versions per arm (interleaved), at least 3")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared: 1 is steadier)")
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    repeats = 3 if args.quick else args.repeats
    if repeats < 3:
        ap.error("--repeats: at least 3")
    torch.set_num_threads(args.threads)

    from earl_stream.store import ShardClient, ShardNode
    from earl_stream.workers.engines.torch_engine import TorchEngine

    base, described = base_model(args.model)
    engine = TorchEngine(copy.deepcopy(base), seed=0)
    order = ["full", *(f"lora_r{r}" for r in RANKS)]
    models = {arm: trainer_side(base, arm) for arm in order}
    del base
    arms: dict[str, list[dict[str, float]]] = {arm: [] for arm in order}
    load_before = os.getloadavg()
    version = 0
    with ShardNode() as node, ShardClient(timeout_s=300.0) as client, \
            progress("lora_sync", (repeats + 1) * len(order), "versions") as bar:
        for rep in range(-1, repeats):  # -1: one untimed version per arm
            turn = order[rep % len(order):] + order[: rep % len(order)] if rep >= 0 else order
            for arm in turn:
                version += 1
                got = one_version(models[arm], arm, version, node, client, engine)
                if rep >= 0:
                    arms[arm].append(got)  # every repeat is in the result; the bar shows the latest
                bar.advance(note=f"{arm} repeat {rep}: {got['bytes']} bytes, {got['total_s']:.4f} s")
    result: dict[str, Any] = {
        "model": described, "lora_targets": list(TARGETS), "ranks": list(RANKS), "repeats": repeats,
        "threads": args.threads, "unit": "one policy version: publish + pull + apply, seconds; bytes of its manifest",
        **summarise(arms), "goals": GOALS,
        "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                    "note": "shared machine: other sessions' tests ran alongside (see the load)"},
    }
    result["notes"] = notes(result)
    if args.json:
        write_result(args.json, result, DEPENDS_ON)
    print_table(result)
    return 0


def notes(result: dict[str, Any]) -> list[str]:
    """Which goal each rank meets, in numbers."""
    out = []
    for r in RANKS:
        b, s = result["sync_bytes_ratio"][f"rank{r}"], result["sync_seconds_ratio"][f"rank{r}"]
        goal = GOALS["sync_seconds_ratio"]
        seconds = "meets" if s["low"] >= goal else "misses" if s["high"] < goal else "its interval spans"
        med = result["sync_seconds_ratio_of_medians"][f"rank{r}"]
        out.append(f"rank {r}: bytes {b:.1f}x ({'meets' if b >= GOALS['sync_bytes_ratio'] else 'misses'} the >= 50x "
                   f"goal), seconds {s['ratio']:.1f}x [95% {s['low']:.1f}, {s['high']:.1f}] ({seconds} the >= 10x goal; "
                   f"ratio of the medians {med:.1f}x)")
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"{'arm':9} {'bytes/version':>14} {'total s':>20} {'publish s':>10} {'pull s':>10} {'apply s':>10}")
    for arm, r in result["arms"].items():
        t = r["total_s"]
        print(f"{arm:9} {r['bytes_per_version']:>14,} {t['mean']:>8.4f} [{t['low']:.4f}, {t['high']:.4f}] "
              f"{r['publish_s']['mean']:>10.4f} {r['pull_s']['mean']:>10.4f} {r['apply_s']['mean']:>10.4f}")
    for line in result["notes"]:
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
