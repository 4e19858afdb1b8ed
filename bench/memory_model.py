"""Validation of the memory model (`earl_stream.supervisor.memory_model`).

    python bench/memory_model.py --json bench/results/memory_model.json [--quick]

(a) Llama-3.1-70B at 4,096 and 8,192 tokens: eager attention without recomputation grows by the
    EARL paper's ratio (~3.65, from Korthikanti et al.'s per-layer s*b*h*(34 + 5*a*s/h) bytes), flash
    attention by 2x. The paper's 97 GB / 354 GB are exactly 16 layers' worth of that formula in GiB
    (b = 1, 2-byte activations): it does not state its layout; the ratio does not depend on it.
(b) Predicted vs measured peak memory of real CPU training steps of two 25-30M-parameter Qwen2 models
    (random init, fp32, one thread), each configuration in a fresh subprocess. Measured: the peak RSS
    (VmHWM, reset through /proc/self/clear_refs) during forward + backward + AdamW step minus the RSS
    just before the forward, with weights, gradients (zero_grad(set_to_none=False)) and AdamW states
    already allocated by a small warm-up step. Predicted: `MemoryBreakdown.dynamic_bytes`. Children
    run with MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns every freed tensor to the OS and RSS
    follows live tensors; with glibc's default dynamic threshold, freed blocks stay in its heaps and
    the peak RSS is higher (one configuration is also measured that way and reported).
(c) The same per rank under sharded plans: 2 gloo ranks under fsdp2, tp2 and sp2, 4 ranks under
    fsdp2_tp2, the model laid out by `workers.sharding.shard_model` and stepped by the real
    `workers.train_step.train_step` (GRPO loss, vocab-parallel log-probs, FSDP2 / DTensor / Ulysses
    collectives; entropy bonus off). Each rank is a fresh process measured as in (b) (its gradients
    made zero tensors before the measured step, like zero_grad(set_to_none=False)); predicted:
    `TrainPlan(dp=fsdp*dp, tp, sp, fsdp=fsdp>1, shard_logits=True, logit_copies=6)`.`dynamic_bytes`
    (6: `LOGIT_COPIES_EARL_VOCAB_PARALLEL`, the vocab-parallel log-prob path train_step runs). Reported:
    `max_relative_error_sharded` over every rank of every plan.
(d) A real model's shape: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9/3 heads, a tied 49,152-token
    vocabulary, so the [b, s, V] logits buffers matter), one process measured as in (b) with the GRPO loss of
    (b), in fp32 and under bf16 autocast with fp32 weights, gradients and AdamW states (as trainer.dtype=bf16
    runs the forward); predicted with Precision.FP32 and Precision.AUTOCAST_BF16 (what the selector plans for
    trainer.dtype=bf16): `dynamic_bytes`, plus under autocast its bf16 copy of the weights (made during the step,
    counted by the model in `weights_bytes`). Random weights: memory does not depend on them.
(e) On a CUDA GPU (`bench/memory_model_cuda.py`, which refreshes this part of the results file): real model shapes
    (SmolLM2-135M, Qwen2.5-0.5B) at 1,024-8,192 tokens, fp32 and bf16 autocast, flash (sdpa) and eager
    attention, with and without full recomputation, one training step each in a fresh process. Measured
    with the CUDA caching allocator's own counters, exact to its 512-byte rounding: the step's peak
    (`max_memory_allocated`) with weights, gradients and AdamW states allocated, against the model's
    `total_bytes` (states + step), and the step's part above the states against `dynamic_bytes`.
(f) The real model at real scale (`bench/memory_model_real.py`; `--only-real-model` refreshes it,
    merging: the cases it runs replace theirs, the others are kept, each row stamped with its commit):
    SmolLM2-135M per rank under dp2 and fsdp2 (its 9 heads rule out tp2 and sp2; tp3/sp3 on 3 ranks instead) at
    1K-8K tokens per micro-batch, in fp32 and bf16 (`dp2+bf16:1024`), tp2 and sp2 on its 8-head / 4-KV-head shape
    (`tp2@heads8:1024`), and a dp2 -> fsdp2 switch with AdamW state, against `predict_train_memory` (and the
    library's switch prediction, where it has one): `max_relative_error_real_model` and
    `max_underprediction_real_model` over every row held (an under-prediction crashes), and
    `max_underprediction_with_learnt_reserve`: the same against the model plus the reserve the selector learns
    from the ranks' peaks, learnt at a layout's smaller token counts and scored at its larger ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import measured_at, write_result  # noqa: E402
from earl_stream.supervisor.memory_model import (  # noqa: E402
    GIB,
    LOGIT_COPIES_EARL_GRPO,
    LOGIT_COPIES_EARL_VOCAB_PARALLEL,
    LOGIT_COPIES_HF_CROSS_ENTROPY,
    Attention,
    ModelShape,
    Precision,
    Recompute,
    TrainPlan,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    predict_kv_cache_bytes,
    predict_train_memory,
)

LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False}
# Two ~25-30M-parameter Qwen2 models. "vocab": 16k tied vocabulary, so the loss's [b, s, V] buffers
# set the peak; "wide": 1k vocabulary, 16 heads and a 2816 SwiGLU, so a layer's backward (softmax
# backward for eager attention, the SwiGLU backward for SDPA) sets it.
MODELS = {
    "vocab": {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
              "intermediate_size": 1408, "vocab_size": 16384, "tie_word_embeddings": True,
              "max_position_embeddings": 4096},
    "wide": {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4,
             "intermediate_size": 2816, "vocab_size": 1024, "tie_word_embeddings": True,
             "max_position_embeddings": 4096},
}
FULL_GRID = [  # (model, attention, loss, seq_len, micro_batch, gradient checkpointing)
    ("vocab", "eager", "ce", 256, 4, False), ("vocab", "eager", "ce", 1024, 1, False),
    ("vocab", "eager", "ce", 512, 2, True), ("vocab", "sdpa", "ce", 1024, 2, False),
    ("vocab", "eager", "grpo", 512, 2, False), ("vocab", "sdpa", "grpo", 1024, 1, True),
    ("wide", "eager", "ce", 1024, 1, False), ("wide", "eager", "ce", 1024, 1, True),
    ("wide", "sdpa", "ce", 1024, 1, False), ("wide", "sdpa", "ce", 512, 2, True),
]
QUICK_GRID = [("vocab", "eager", "ce", 256, 2, False), ("wide", "eager", "ce", 512, 1, True),
              ("wide", "sdpa", "ce", 512, 2, False)]
SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
# (seq_len, micro_batch, dtype); bf16 autocast steps are slow on these CPUs (376 s for 128 tokens, loaded machine)
SMOLLM2_GRID = [(128, 1, "fp32"), (512, 1, "fp32"), (1024, 1, "fp32"), (128, 1, "bf16"), (1024, 1, "bf16")]
SMOLLM2_QUICK = [(128, 1, "fp32")]
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def part_a() -> dict:
    shape = ModelShape.from_hf(LLAMA_70B)
    out: dict = {"model": "Llama-3.1-70B", "config": LLAMA_70B, "micro_batch": 1, "seq_lens": [4096, 8192]}
    for name in ("korthikanti", "hf_bf16"):
        rows = {}
        for attn in (Attention.EAGER, Attention.FLASH):
            plans = [TrainPlan(1, s, attention=attn, precision=Precision.MIXED_BF16) for s in (4096, 8192)]
            per_layer = [korthikanti_layer_bytes(shape, p) if name == "korthikanti" else
                         layer_activation_bytes(shape, p).saved_bytes for p in plans]
            rows[attn.value] = {"per_layer_gib": [x / GIB for x in per_layer],
                                "all_80_layers_gib": [80 * x / GIB for x in per_layer],
                                "ratio_8192_over_4096": per_layer[1] / per_layer[0]}
        out[name] = rows
    out["paper_gb"] = [97, 354]
    out["paper_equivalent_16_layers_gib"] = [16 * x for x in out["korthikanti"]["eager"]["per_layer_gib"]]
    out["paper_assumptions"] = ("Korthikanti Table 2 without parallelism or recomputation, b=1, 2-byte "
                                "activations, 1-byte dropout masks: sbh*(34 + 5*a*s/h) bytes per layer; the paper's "
                                "figures equal 16 layers of it in GiB (e.g. one stage of a 5-stage pipeline over 80 "
                                "layers)")
    out["hf_total_per_device_gib_8192_fsdp8_flash_mixed_bf16"] = {
        p.value: predict_train_memory(shape, TrainPlan(1, 8192, dp=8, fsdp=True, recompute=p, attention=Attention.FLASH,
                                                       precision=Precision.MIXED_BF16)).total_bytes / GIB
        for p in Recompute}
    out["kv_cache_bytes_per_token_bf16"] = predict_kv_cache_bytes(shape, 1, dtype_bytes=2)
    return out


def child(spec: dict) -> dict:
    """Run in a fresh process: build, warm up, measure one step's peak RSS delta."""
    import gc

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    rss0 = status("VmRSS:")
    device = torch.device(spec.get("device", "cpu"))
    if spec.get("arch") == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**spec["config"], attn_implementation=spec["attn"], use_cache=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**spec["config"], attn_implementation=spec["attn"], use_cache=False))
    autocast = spec.get("dtype") == "bf16"
    model.to(device).train()
    if spec["ckpt"]:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = spec["config"]["vocab_size"]

    def step(b: int, s: int) -> None:
        ids = torch.randint(0, vocab, (b, s), device=device)
        if spec["loss"] == "ce":
            model(input_ids=ids, labels=ids).loss.backward()
        else:  # the inner loop of earl_stream.workers.train_step (GRPO, entropy_coef = 0)
            from earl_stream.algo.losses import policy_loss, token_entropy, token_logprobs
            from earl_stream.config import AlgoConfig
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):  # as train_step does for bf16
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
                logp = token_logprobs(out.logits, ids)
            ent = token_entropy(out.logits.detach())
            terms = policy_loss(logp, logp.detach() - 0.01, torch.linspace(-1, 1, b, device=device),
                                torch.ones(b, s, device=device), torch.full((b,), 1.0 / (b * s), device=device),
                                AlgoConfig(entropy_coef=0.0), entropy=ent)
            terms.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    step(1, 32)
    gc.collect()
    if device.type == "cuda":  # the caching allocator's counters: exact, no allocator slack to reason about
        torch.cuda.synchronize()
        states = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.monotonic()
        step(spec["micro_batch"], spec["seq_len"])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"measured_bytes": peak - states, "measured_total_bytes": peak, "states_bytes": states,
                "step_seconds": time.monotonic() - start}
    base = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.monotonic()
    step(spec["micro_batch"], spec["seq_len"])
    return {"measured_bytes": status("VmHWM:") - base, "baseline_rss_bytes": base, "states_rss_bytes": base - rss0,
            "step_seconds": time.monotonic() - start}


def predict(spec: dict) -> tuple[int, int, str]:
    from transformers import Qwen2Config

    shape = ModelShape.from_hf(Qwen2Config(**spec["config"]))
    plan = TrainPlan(micro_batch=spec["micro_batch"], seq_len=spec["seq_len"],
                     attention=Attention.EAGER if spec["attn"] == "eager" else Attention.FLASH,
                     recompute=Recompute.FULL if spec["ckpt"] else Recompute.NONE,
                     logit_copies=LOGIT_COPIES_EARL_GRPO if spec["loss"] == "grpo" else LOGIT_COPIES_HF_CROSS_ENTROPY)
    bd = predict_train_memory(shape, plan)
    return bd.dynamic_bytes, bd.static_bytes, bd.peak_phase.value


def run_child(spec: dict, *, default_malloc: bool = False) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if not default_malloc:
        env.update(MALLOC_ENV)
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                         text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"child failed for {spec}:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def part_b(grid: list, *, default_malloc_check: bool) -> dict:
    rows = []
    print(f"  {'model':5s} {'attn':5s} {'loss':4s} {'seq':>5s} {'mb':>2s} ckpt {'predicted':>10s} {'measured':>10s} "
          f"{'error':>7s}  peak phase")
    for name, attn, loss, s, b, ckpt in grid:
        spec = {"model": name, "config": MODELS[name], "attn": attn, "loss": loss, "seq_len": s, "micro_batch": b,
                "ckpt": ckpt}
        got = run_child(spec)
        pred, static, phase = predict(spec)
        rel = (pred - got["measured_bytes"]) / got["measured_bytes"]
        rows.append({**{k: v for k, v in spec.items() if k != "config"}, "predicted_bytes": pred, **got,
                     "relative_error": rel, "predicted_peak_phase": phase, "predicted_static_bytes": static})
        print(f"  {name:5s} {attn:5s} {loss:4s} {s:5d} {b:2d} {int(ckpt):4d} {pred / 2**20:6.1f} MiB "
              f"{got['measured_bytes'] / 2**20:6.1f} MiB {rel:+7.3f}  {phase} ({got['step_seconds']:.1f} s step)",
              flush=True)
    params = {k: ModelShape.from_hf({**v, "model_type": "qwen2"}).num_params() for k, v in MODELS.items()}
    out = {"models": {k: {**v, "params": params[k]} for k, v in MODELS.items()},
           "dtype": "float32", "threads": 1, "malloc_env": MALLOC_ENV, "configs": rows,
           "max_relative_error": max(abs(r["relative_error"]) for r in rows)}
    if default_malloc_check:
        spec = {"model": "vocab", "config": MODELS["vocab"], "attn": "eager", "loss": "ce", "seq_len": 512,
                "micro_batch": 2, "ckpt": False}
        got = run_child(spec, default_malloc=True)
        out["default_malloc_check"] = {**{k: v for k, v in spec.items() if k != "config"},
                                       "measured_bytes": got["measured_bytes"], "predicted_bytes": predict(spec)[0],
                                       "note": "glibc default mmap threshold: freed blocks are kept, RSS overstates"}
    return out


def part_d(grid: list) -> dict:
    from transformers import LlamaConfig

    shape = ModelShape.from_hf(LlamaConfig(**SMOLLM2))
    rows = []
    for s, b, dtype in grid:
        spec = {"model": "smollm2", "arch": "llama", "config": SMOLLM2, "attn": "sdpa", "loss": "grpo", "seq_len": s,
                "micro_batch": b, "ckpt": False, "dtype": dtype}
        got = run_child(spec)
        plan = TrainPlan(micro_batch=b, seq_len=s, attention=Attention.FLASH, logit_copies=LOGIT_COPIES_EARL_GRPO,
                         precision=Precision.AUTOCAST_BF16 if dtype == "bf16" else Precision.FP32)
        bd = predict_train_memory(shape, plan)
        # autocast's bf16 copy of the weights is made during the step; the model counts it in weights_bytes
        pred = bd.dynamic_bytes + (bd.weights_bytes - 4 * shape.num_params() if dtype == "bf16" else 0)
        rel = (pred - got["measured_bytes"]) / got["measured_bytes"]
        rows.append({**{k: v for k, v in spec.items() if k != "config"}, "predicted_bytes": pred, **got,
                     "relative_error": rel, "predicted_peak_phase": bd.peak_phase.value})
        print(f"  smollm2 {dtype} s={s:4d} b={b} predicted {pred / 2**20:7.1f} MiB measured "
              f"{got['measured_bytes'] / 2**20:7.1f} MiB {rel:+.3f} ({got['step_seconds']:.1f} s step)", flush=True)
    return {"model": "SmolLM2-135M-Instruct shape", "config": SMOLLM2, "params": shape.num_params(), "configs": rows,
            "max_relative_error": max(abs(r["relative_error"]) for r in rows)}


# (plan, model, attention, seq_len, rows per data rank): 2 ranks under fsdp2, tp2, sp2; 4 under fsdp2_tp2;
# dp1: one rank, the control
SHARDED_FULL = [("fsdp2", "vocab", "sdpa", 1024, 1), ("fsdp2", "wide", "eager", 1024, 1),
                ("tp2", "vocab", "sdpa", 1024, 1), ("tp2", "wide", "eager", 1024, 1),
                ("sp2", "vocab", "sdpa", 1024, 1), ("sp2", "wide", "eager", 1024, 1),
                ("fsdp2_tp2", "vocab", "sdpa", 1024, 1), ("dp1", "vocab", "sdpa", 1024, 1)]
SHARDED_QUICK = [("fsdp2", "vocab", "sdpa", 512, 1), ("tp2", "vocab", "sdpa", 512, 1), ("sp2", "vocab", "sdpa", 512, 1),
                 ("fsdp2_tp2", "vocab", "sdpa", 512, 1)]


def _claim(n_rows: int, length: int, vocab: int, tag: str) -> tuple[list, object]:
    """`n_rows` rows of `length` tokens (two GRPO groups), random ids, every response token in the loss."""
    import numpy as np

    from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, sample_key

    rng = np.random.default_rng(0)
    rows, metas = {}, []
    for i in range(n_rows):
        sid, prompt = f"{tag}{i}", min(8, length - 1)
        mask = np.zeros(length, np.uint8)
        mask[prompt:] = 1
        rows[sample_key(sid, "input_ids")] = rng.integers(5, vocab, length).astype(np.int32)
        rows[sample_key(sid, "loss_mask")] = mask
        rows[sample_key(sid, "behaviour_logprobs")] = np.full(length, -np.log(vocab), np.float32) * mask
        metas.append(SampleMeta(schema_version=SCHEMA_VERSION, sample_id=sid, prompt_ordinal=i % 2, episode_id=sid,
                                group_id=f"g{i % 2}", env="bench", turns=1, prompt_tokens=prompt,
                                response_tokens=length - prompt, total_tokens=length, reward=float(i % 3),
                                advantage=None, policy_version_min=0, policy_version_max=0, producer_id="p",
                                producer_address="local", checksum=0, created_at=0.0, info_json="{}"))
    from earl_stream.store.experience import InProcessPuller

    return metas, InProcessPuller(rows)


def rank_child(spec: dict, rank: int, world: int, port: int) -> dict:
    """One trainer rank of a sharded configuration: warm up, then measure one step's peak RSS delta."""
    import gc

    import torch
    import torch.distributed as dist

    from bench.ranks import join, laid_out_model
    from earl_stream.config import AlgoConfig, TrainerConfig
    from earl_stream.workers.train_step import train_step

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    join(rank, world, port)
    rss0 = status("VmRSS:")
    model, placement = laid_out_model(MODELS[spec["model"]], spec["attn"], spec["plan"], rank, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg, algo = TrainerConfig(micro_batch_tokens=1 << 20), AlgoConfig(entropy_coef=0.0)
    vocab, data_ranks = MODELS[spec["model"]]["vocab_size"], placement.plan.data_ranks
    metas, rows = _claim(data_ranks, 32, vocab, "warm")
    train_step(model, opt, metas, placement.layout, rows, cfg, algo=algo, placement=placement)
    for p in model.parameters():  # allocated states, as zero_grad(set_to_none=False) leaves them
        p.grad = torch.zeros_like(p)
    metas, rows = _claim(data_ranks * spec["rows"], spec["seq_len"], vocab, "big")
    gc.collect()
    dist.barrier()
    base = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.monotonic()
    train_step(model, opt, metas, placement.layout, rows, cfg, algo=algo, placement=placement)
    out = {"rank": rank, "measured_bytes": status("VmHWM:") - base, "baseline_rss_bytes": base,
           "states_rss_bytes": base - rss0, "step_seconds": time.monotonic() - start}
    dist.destroy_process_group()
    return out


def predict_sharded(spec: dict) -> tuple[int, int, str]:
    from bench.ranks import rank_plan

    rp = rank_plan(spec["plan"])
    shape = ModelShape.from_hf({**MODELS[spec["model"]], "model_type": "qwen2"})
    plan = TrainPlan(micro_batch=spec["rows"], seq_len=spec["seq_len"], dp=rp.dp * rp.fsdp, tp=rp.tp, sp=rp.sp,
                     fsdp=rp.fsdp > 1, shard_logits=True, logit_copies=LOGIT_COPIES_EARL_VOCAB_PARALLEL,
                     attention=Attention.EAGER if spec["attn"] == "eager" else Attention.FLASH)
    bd = predict_train_memory(shape, plan)
    return bd.dynamic_bytes, bd.static_bytes, bd.peak_phase.value


def part_c(grid: list) -> dict:
    from bench.ranks import launch, rank_plan

    rows = []
    print(f"  {'plan':10s} {'model':5s} {'attn':5s} {'seq':>5s} {'mb':>2s} {'predicted':>10s}  measured per rank "
          "(error)   peak phase")
    for plan, name, attn, s, b in grid:
        spec = {"plan": plan, "model": name, "attn": attn, "seq_len": s, "rows": b}
        ranks = launch(__file__, ["--rank-child", json.dumps(spec)], rank_plan(plan).world, env=MALLOC_ENV)
        pred, static, phase = predict_sharded(spec)
        for r in ranks:
            r["relative_error"] = (pred - r["measured_bytes"]) / r["measured_bytes"]
        rows.append({**spec, "predicted_bytes": pred, "predicted_static_bytes": static, "predicted_peak_phase": phase,
                     "ranks": ranks, "max_abs_relative_error": max(abs(r["relative_error"]) for r in ranks)})
        per_rank = " ".join(f"{r['measured_bytes'] / 2**20:6.1f} ({r['relative_error']:+.3f})" for r in ranks)
        print(f"  {plan:10s} {name:5s} {attn:5s} {s:5d} {b:2d} {pred / 2**20:6.1f} MiB  {per_rank}  {phase} "
              f"({max(r['step_seconds'] for r in ranks):.1f} s step)", flush=True)
    # dp1 (one rank, same train_step) is the control: it is not a sharded plan
    return {"configs": rows, "max_relative_error_sharded": max(r["max_abs_relative_error"] for r in rows
                                                               if r["plan"] != "dp1")}


KEPT_PARTS = ("cuda", "real_model", "max_relative_error_real_model", "max_underprediction_real_model",
              "max_underprediction_with_learnt_reserve")  # refreshed by their own runs, kept by a full one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/memory_model.json", help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="three small configurations (~1 minute)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--rank-child", help=argparse.SUPPRESS)
    for flag in ("--rank", "--world", "--port"):
        ap.add_argument(flag, type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--only-sharded", action="store_true", help="skip (a) and (b): the sharded plans only")
    ap.add_argument("--only-smollm2", action="store_true", help="refresh (d), the SmolLM2 rows, in an existing file")
    ap.add_argument("--only-real-model", action="store_true",
                    help="refresh (f), SmolLM2 per rank at 1K-8K tokens and a switch, in an existing file")
    ap.add_argument("--real-grid", default="", help="(f)'s cases, comma-separated: PLAN[@SHAPE]:TOKENS (dp2:1024, "
                    "fsdp2+rc:4096, tp3:2048, tp2@heads8:1024; SHAPE heads8: SmolLM2 with 8/4 heads) or "
                    "switch:OLD>NEW:0; default: all of 1K-8K under dp2 and fsdp2, tp2@heads8 and sp2@heads8 at 1K-2K "
                    "(--quick: dp2 and fsdp2 at 1K) and a dp2 -> fsdp2 switch; rows of other cases in --json are kept")
    ap.add_argument("--real-rank-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.rank_child:
        print(json.dumps(rank_child(json.loads(args.rank_child), args.rank, args.world, args.port)))
        return 0
    if args.real_rank_child:
        from memory_model_real import real_rank_child

        print(json.dumps(real_rank_child(json.loads(args.real_rank_child), args.rank, args.world, args.port)))
        return 0
    start = time.monotonic()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only_smollm2:  # refresh (d) in an existing results file
        result = json.loads(out.read_text()) if out.exists() else {}
        result["smollm2"] = part_d(SMOLLM2_QUICK if args.quick else SMOLLM2_GRID)
        write_result(out, result, indent=2)
        print(f"  smollm2 max_relative_error = {result['smollm2']['max_relative_error']:.3f}; wrote {out}")
        return 0
    if args.only_real_model:  # refresh (f) in an existing results file
        from memory_model_real import REAL_FULL, REAL_QUICK, merge, part_f

        grid = args.real_grid.split(",") if args.real_grid else REAL_QUICK if args.quick else REAL_FULL
        result = json.loads(out.read_text()) if out.exists() else {}
        print("(f) SmolLM2-135M per rank, predicted vs measured peak (total = states + step)")
        at = measured_at()  # the tree the run starts from (before any row: a row names the code it measured)
        f = merge(result.get("real_model", {}), part_f(grid, __file__), grid, at)  # other cases' rows kept
        result.update({k: f[k] for k in ("max_relative_error_real_model", "max_underprediction_real_model",
                                           "max_underprediction_with_learnt_reserve")}, real_model=f)
        write_result(out, result, indent=2)
        print(f"  max_relative_error_real_model = {f['max_relative_error_real_model']} (goal <= 0.05), "
              f"max_underprediction_real_model = {f['max_underprediction_real_model']} (goal <= 0.02), with the "
              f"learnt reserve {f['max_underprediction_with_learnt_reserve']}; wrote {out}")
        return 0
    if args.only_sharded:  # refresh (c) in an existing results file
        result = json.loads(out.read_text()) if out.exists() else {}
        c = part_c(SHARDED_QUICK if args.quick else SHARDED_FULL)
        result.update(sharded=c, max_relative_error_sharded=c["max_relative_error_sharded"])
        write_result(out, result, indent=2)
        print(f"  max_relative_error_sharded = {c['max_relative_error_sharded']:.3f} (goal <= 0.05); wrote {out}")
        return 0
    a = part_a()
    print("(a) Llama-3.1-70B activations per layer, b=1 (GiB): 4,096 -> 8,192 tokens")
    for name in ("korthikanti", "hf_bf16"):
        for attn, r in a[name].items():
            g = r["per_layer_gib"]
            print(f"  {name:11s} {attn:5s} {g[0]:8.3f} -> {g[1]:8.3f}   x{r['ratio_8192_over_4096']:.3f}"
                  f"   (80 layers: {r['all_80_layers_gib'][0]:.0f} -> {r['all_80_layers_gib'][1]:.0f} GiB)")
    p = a["paper_equivalent_16_layers_gib"]
    print(f"  paper: 97 GB -> 354 GB; 16 layers of Korthikanti eager: {p[0]:.1f} -> {p[1]:.1f} GiB")
    print(f"  KV cache bf16: {a['kv_cache_bytes_per_token_bf16'] / 1024:.0f} KiB/token")
    print(f"(b) predicted vs measured step peak above the allocated states ({'quick' if args.quick else 'full'})")
    b = part_b(QUICK_GRID if args.quick else FULL_GRID, default_malloc_check=not args.quick)
    print(f"  max_relative_error = {b['max_relative_error']:.3f} (target <= 0.10)")
    if "default_malloc_check" in b:
        c = b["default_malloc_check"]
        print(f"  default glibc malloc, vocab eager s=512 b=2: measured {c['measured_bytes'] / 2**20:.1f} MiB "
              f"vs predicted {c['predicted_bytes'] / 2**20:.1f} MiB")
    print(f"(c) per rank under sharded plans, predicted vs measured step peak ({'quick' if args.quick else 'full'})")
    c = part_c(SHARDED_QUICK if args.quick else SHARDED_FULL)
    print(f"  max_relative_error_sharded = {c['max_relative_error_sharded']:.3f} (goal <= 0.05)")
    print(f"(d) SmolLM2-135M shape, fp32 and bf16 autocast ({'quick' if args.quick else 'full'})")
    d = part_d(SMOLLM2_QUICK if args.quick else SMOLLM2_GRID)
    kept = json.loads(out.read_text()) if out.exists() else {}  # the parts this run does not measure: (e), (f)
    result = {**{k: kept[k] for k in KEPT_PARTS if k in kept}, "llama70b": a, "measured": b,
              "max_relative_error": b["max_relative_error"], "sharded": c, "smollm2": d,
              "max_relative_error_sharded": c["max_relative_error_sharded"], "quick": args.quick,
              "seconds": round(time.monotonic() - start, 1)}
    write_result(out, result, indent=2)
    print(f"wrote {out} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
