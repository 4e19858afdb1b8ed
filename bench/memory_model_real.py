"""Part (f) of bench/memory_model.py: the memory model at real scale.

    python bench/memory_model.py --only-real-model [--quick] [--real-grid dp2:1024,fsdp2:2048,tp2@heads8:1024,...]

SmolLM2-135M-Instruct (the imported model of `make real-model`, else random weights of its config: memory does
not depend on them), fp32, SDPA attention, laid out by `workers.sharding.shard_model` on a pool of gloo ranks
and stepped by the real `workers.train_step.train_step` (GRPO loss, vocab-parallel log-probs), one micro-batch
of N tokens per data rank (one packed micro-batch of N tokens; until packing is merged, one N-token sequence is
that micro-batch). Each rank is a fresh process with MALLOC_MMAP_THRESHOLD_=65536 (resident memory follows live
tensors). Measured per rank: the peak resident memory (VmHWM, reset through /proc/self/clear_refs) during one
step, (i) above the memory before the model was built ("total": states + step, what a cap sees beyond the
runtime) and (ii) above the memory just before the step ("dynamic", as parts (b)-(d) measure). The runtime is
everything imported before that first reading (`_import_runtime`: transformers' Llama modelling, the mesh and
sharding code, the loader); rows measured before it was (at or before d5e7745) counted what those imports add
after the process group's start as model states (importing transformers' Llama modelling into a bare process
is ~95 MiB of RSS): re-measured with it (2026-12-04, beside other load), dp2 1024 went from -1.57% to -1.2%
and tp2@heads8 1024 from -2.35% to -2.05%; the states are still measured ~46-52 MB above their prediction. Predicted:
`predict_train_memory(shape, TrainPlan(micro_batch=1, seq_len=N, dp=data ranks, tp, sp, fsdp, recompute,
attention=FLASH, logit_copies=LOGIT_COPIES_EARL_VOCAB_PARALLEL))`, its `total_bytes` and `dynamic_bytes`; and, as
the selector's fit checks use it, that total plus the reserve learnt from the same layout's smaller rows
(`learnt_reserve`).
A switch: the same ranks under plan A, one warm-up step (AdamW state allocated), then `sharding.relayout` to
plan B as the trainer does at a plan change; measured: the peak above the memory before the model was built;
predicted: the library's switch prediction where it has one (`supervisor.switch_memory.predict_switch`, with
trainer.reshard_bucket_bytes' 64 MiB), else none (the full-state-dict path's estimate is reported beside it as
`full_gather_estimate_bytes`, not scored).
SmolLM2 has 9 attention heads and 3 KV heads: tp2 and sp2 cannot run on it (refused by the layouts); tp3 and
sp3 (3 ranks) can, and are in the grid instead when --real-grid names them. tp2 and sp2 run on `heads8`
(`PLAN@heads8:TOKENS`, e.g. `tp2@heads8:1024`): SmolLM2-135M's config with 8 attention heads and 4 KV heads
(head_dim 72 = hidden 576 / 8, the shape of bench/real_scale.py's `build_heads8_model`), random weights built in
each rank (memory does not depend on them), predicted with `ModelShape.from_hf` of that same config.

A run merges into the results file (bench/memory_model.py does the write): its rows replace the rows of the same
case, the others are kept, each row's `measured_at` names the date and commit (`+dirty`: the tracked code differed
from it) whose tree measured it; the scores are recomputed over every row held.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from earl_stream.supervisor.decisions import DTYPE_PRECISION
from earl_stream.supervisor.memory_model import (
    LOGIT_COPIES_EARL_VOCAB_PARALLEL,
    Attention,
    ModelShape,
    Recompute,
    TrainPlan,
    predict_train_memory,
)

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
REAL_FULL = ([f"{p}:{n}" for p in ("dp2", "fsdp2") for n in (1024, 2048, 4096, 8192)]
             + [f"{p}@heads8:{n}" for p in ("tp2", "sp2") for n in (1024, 2048)] + ["switch:dp2>fsdp2:0"])
REAL_QUICK = ["dp2:1024", "fsdp2:1024", "switch:dp2>fsdp2:0"]
NOT_RUNNABLE = {"tp2": "SmolLM2's 9 attention heads (3 KV heads) are not divisible by 2 (tp2@heads8 runs instead)",
                "sp2": "SmolLM2's 9 attention heads are not divisible by 2 (Ulysses splits heads; sp2@heads8 runs "
                       "instead)"}
SHAPES = {"smollm2": "SmolLM2-135M-Instruct's config (9 attention heads, 3 KV heads, head_dim 64)",
          "heads8": "SmolLM2-135M-Instruct's config with 8 attention heads and 4 KV heads (head_dim 72 = 576 / 8, as "
                    "bench/real_scale.py's build_heads8_model), random weights (seed 0)"}


def model_dir() -> Path | None:
    from earl_stream.model import cache_dir

    d = cache_dir() / "models" / "smollm2-135m-instruct"
    return d if (d / "config.json").is_file() else None


def smollm2_config() -> dict[str, Any]:
    d = model_dir()
    if d is not None:
        return json.loads((d / "config.json").read_text())
    from memory_model import SMOLLM2  # type: ignore[import-not-found]

    return {**SMOLLM2, "model_type": "llama"}


def heads8_config() -> dict[str, Any]:
    """SmolLM2-135M's config with 8 attention heads and 4 KV heads; head_dim follows hidden / heads (72), as in
    bench/real_scale.py's heads8 model (built from a config without head_dim)."""
    cfg = {k: v for k, v in smollm2_config().items()
           if k not in ("head_dim", "architectures", "transformers_version", "dtype", "torch_dtype")}
    return {**cfg, "model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 4}


def shape_config(shape: str | None) -> dict[str, Any]:
    """The config of a grid case's model shape: None or `smollm2` (SmolLM2-135M itself), `heads8`."""
    if shape in (None, "", "smollm2"):
        return smollm2_config()
    if shape == "heads8":
        return heads8_config()
    raise ValueError(f"unknown model shape {shape!r} (known: {', '.join(SHAPES)})")


def parse_case(item: str) -> tuple[str, str | None, int]:
    """`PLAN[@SHAPE]:TOKENS` -> (plan, shape or None, tokens); `tp2@heads8:1024` -> ("tp2", "heads8", 1024)."""
    kind, rest = item.split(":", 1)
    plan, _, shape = kind.partition("@")
    if shape:
        shape_config(shape)  # an unknown shape fails here, before any rank starts
    return plan, shape or None, int(rest)


def case_name(plan: str, shape: str | None, tokens: int) -> str:
    return f"{plan}{'@' + shape if shape else ''} {tokens}"


def rank_plan(name: str) -> Any:
    """`RankPlan` from `dp2`, `fsdp2+rc`, `tp3`, `sp3`, `dp2+bf16`, `fsdp2+rc+bf16`, ..."""
    from earl_stream.workers.mesh import RankPlan

    bf16 = name.endswith("+bf16")
    base = name.removesuffix("+bf16")
    base, rc = base.removesuffix("+rc"), base.endswith("+rc")
    axis = base.rstrip("0123456789")
    return RankPlan(**{axis: int(base[len(axis):])}, micro_batch_tokens=1 << 20, recompute=rc,
                    dtype="bf16" if bf16 else "fp32")


def _import_runtime() -> None:
    """Import what building and stepping a plan imports (modules are the runtime's memory, not the plan's), so that
    the reading before the build counts them: transformers' Llama modelling and loading, DTensor's mesh and the
    sharding code."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    from earl_stream.model import load_model  # noqa: F401
    from earl_stream.workers.mesh import TrainerMesh  # noqa: F401
    from earl_stream.workers.sharding import apply_plan, relayout, shard_model  # noqa: F401


def _build(plan_name: str, rank: int, world: int, shape: str | None = None) -> tuple[Any, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from earl_stream.workers.mesh import TrainerMesh
    from earl_stream.workers.sharding import apply_plan, shard_model

    torch.manual_seed(0)
    d = model_dir() if shape in (None, "", "smollm2") else None
    if d is not None:
        from earl_stream.model import load_model

        model, _ = load_model(str(d))
    else:  # SmolLM2's config without its weights, or another shape of it (heads8): random weights
        model = LlamaForCausalLM(LlamaConfig(**{**shape_config(shape), "attn_implementation": "sdpa",
                                                "use_cache": False}))
    model.config.use_cache = False
    model.train()
    placement = TrainerMesh(world, rank, torch.device("cpu")).placement(rank_plan(plan_name))
    shard_model(model, placement)
    apply_plan(model, placement)
    return model, placement


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def real_rank_child(spec: dict[str, Any], rank: int, world: int, port: int) -> dict[str, Any]:
    """One rank: build the plan, warm up (AdamW state), then measure one N-token step or one switch."""
    import gc

    import torch
    import torch.distributed as dist
    from memory_model import _claim  # type: ignore[import-not-found]

    from bench.ranks import join
    from earl_stream.config import AlgoConfig, TrainerConfig
    from earl_stream.workers.sharding import relayout
    from earl_stream.workers.train_step import train_step

    join(rank, world, port)
    _import_runtime()
    rss0 = _status("VmRSS:")
    plans = spec["plan"].split(">")
    model, placement = _build(plans[0], rank, world, spec.get("shape"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cfg, algo = TrainerConfig(micro_batch_tokens=1 << 20), AlgoConfig(entropy_coef=0.0)
    vocab, data_ranks = model.config.vocab_size, placement.plan.data_ranks
    metas, rows = _claim(data_ranks, 32, vocab, "warm")
    train_step(model, opt, metas, placement.layout, rows, cfg, algo=algo, placement=placement)
    for p in model.parameters():  # allocated states, as zero_grad(set_to_none=False) leaves them
        p.grad = torch.zeros_like(p)
    start = time.monotonic()
    if len(plans) == 2:  # a switch, as the trainer makes it at a plan change
        from earl_stream.workers.mesh import TrainerMesh

        new = TrainerMesh(world, rank, torch.device("cpu")).placement(rank_plan(plans[1]))
        for p in model.parameters():
            p.grad = None  # the trainer switches between steps, after zero_grad(set_to_none=True)
        gc.collect()
        dist.barrier()
        base = _status("VmRSS:")
        _reset_peak()
        import inspect

        bucket = {"bucket_bytes": 64 << 20} if "bucket_bytes" in inspect.signature(relayout).parameters else {}
        relaid = relayout(model, opt, new, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-6), **bucket)
        peak = _status("VmHWM:")
        del model, opt
        gc.collect()
        after = _status("VmRSS:")
        out = {"rank": rank, "peak_total_bytes": peak - rss0, "peak_above_before_bytes": peak - base,
               "before_bytes": base - rss0, "after_bytes": after - rss0, "seconds": time.monotonic() - start}
        del relaid
    else:
        metas, rows = _claim(data_ranks, spec["tokens"], vocab, "big")
        gc.collect()
        dist.barrier()
        base = _status("VmRSS:")
        _reset_peak()
        train_step(model, opt, metas, placement.layout, rows, cfg, algo=algo, placement=placement)
        peak = _status("VmHWM:")
        out = {"rank": rank, "measured_total_bytes": peak - rss0, "measured_bytes": peak - base,
               "states_rss_bytes": base - rss0, "step_seconds": time.monotonic() - start}
    dist.destroy_process_group()
    return out


def predict(plan_name: str, tokens: int, model_shape: str | None = None) -> Any:
    rp = rank_plan(plan_name)
    shape = ModelShape.from_hf(shape_config(model_shape))
    plan = TrainPlan(micro_batch=1, seq_len=tokens, dp=rp.data_ranks, tp=rp.tp, sp=rp.sp, fsdp=rp.fsdp > 1,
                     recompute=Recompute.FULL if rp.recompute else Recompute.NONE, attention=Attention.FLASH,
                     shard_logits=True, logit_copies=LOGIT_COPIES_EARL_VOCAB_PARALLEL,
                     precision=DTYPE_PRECISION[rp.dtype])  # as the selector plans trainer.dtype
    return shape, plan, predict_train_memory(shape, plan)


BUCKET_BYTES = 64 << 20  # trainer.reshard_bucket_bytes' default once re-sharding without a replica is merged


def predict_switch(old: str, new: str) -> tuple[int | None, int, str]:
    """(the library's switch prediction or None, an estimate of the full-state-dict path, what answered).

    The estimate is old states + new states + a full replica's weights and AdamW moments: what gathering full
    state dicts materialises from a sharded placement (from a replicated one the full state dict is the old
    tensors themselves, so it over-counts a dp -> fsdp switch)."""
    shape, a, bd_a = predict(old, 1)
    _, b, bd_b = predict(new, 1)
    no_grads = bd_a.static_bytes - bd_a.gradients_bytes + bd_b.static_bytes - bd_b.gradients_bytes
    estimate = no_grads + shape.num_params() * 12  # fp32 weights + AdamW's two moments
    try:
        from earl_stream.supervisor.switch_memory import predict_switch as library
    except ImportError:
        return None, estimate, ""
    got = library(shape, a, b, BUCKET_BYTES, stepped=True)
    return int(got.peak_bytes), estimate, f"switch_memory.predict_switch (bucket {BUCKET_BYTES >> 20} MiB)"


def part_f(grid: list[str], script: str) -> dict[str, Any]:
    from bench.ranks import launch

    rows = []
    for item in grid:
        kind, rest = item.split(":", 1)
        if kind == "switch":
            plans, tokens = rest.split(":")
            old, new = plans.split(">")
            ranks = launch(script, ["--real-rank-child", json.dumps({"plan": plans, "tokens": 0})],
                           rank_plan(old).world, env=MALLOC_ENV)
            pred, estimate, fn = predict_switch(old, new)
            measured = max(r["peak_total_bytes"] for r in ranks)
            row = {"case": f"switch {old} -> {new}", "ranks": ranks, "measured_peak_bytes": measured,
                   "predicted_bytes": pred, "predicted_by": fn or None, "full_gather_estimate_bytes": estimate,
                   "relative_error": (pred - measured) / measured if pred else None}
            print(f"  switch {old:>6s} -> {new:6s} measured {measured / 2**20:8.1f} MiB  predicted "
                  f"{(pred or 0) / 2**20:8.1f} MiB ({fn or 'no switch prediction in the library'}); full-gather "
                  f"estimate {estimate / 2**20:.1f} MiB", flush=True)
            rows.append(row)
            continue
        plan, shape, tokens = parse_case(item)
        case, tag = case_name(plan, shape, tokens), {"shape": shape} if shape else {}
        if shape is None and plan.split("+")[0] in NOT_RUNNABLE:
            rows.append({"case": case, "plan": plan, "tokens": tokens, "not_runnable": NOT_RUNNABLE[plan.split("+")[0]]})
            continue
        ranks = launch(script, ["--real-rank-child", json.dumps({"plan": plan, "tokens": tokens, **tag})],
                       rank_plan(plan).world, env=MALLOC_ENV, timeout_s=3600)
        _, _, bd = predict(plan, tokens, shape)
        for r in ranks:
            r["relative_error_total"] = (bd.total_bytes - r["measured_total_bytes"]) / r["measured_total_bytes"]
            r["relative_error_dynamic"] = (bd.dynamic_bytes - r["measured_bytes"]) / r["measured_bytes"]
            r["states_relative_error"] = (bd.static_bytes - r["states_rss_bytes"]) / r["states_rss_bytes"]
        worst = max(ranks, key=lambda r: abs(r["relative_error_total"]))
        rows.append({"case": case, "plan": plan, **tag, "tokens": tokens, "predicted_total_bytes": bd.total_bytes,
                     "predicted_bytes": bd.dynamic_bytes, "predicted_static_bytes": bd.static_bytes,
                     "predicted_peak_phase": bd.peak_phase.value, "ranks": ranks,
                     "relative_error": worst["relative_error_total"],
                     "relative_error_dynamic": max((r["relative_error_dynamic"] for r in ranks), key=abs)})
        per_rank = " ".join(f"{r['measured_total_bytes'] / 2**20:7.1f} ({r['relative_error_total']:+.3f}; step "
                            f"{r['relative_error_dynamic']:+.3f}; states {r['states_relative_error']:+.3f})"
                            for r in ranks)
        print(f"  {case:20s} predicted {bd.total_bytes / 2**20:7.1f} MiB ({bd.peak_phase.value})  measured "
              f"per rank {per_rank}  ({max(r['step_seconds'] for r in ranks):.0f} s step)", flush=True)
    return {"model": "SmolLM2-135M-Instruct" + ("" if model_dir() else " (config only: random weights)"),
            "dtype": "float32; PLAN+bf16: trainer.dtype=bf16 (autocast, FSDP2 gathers bf16)", "attention": "sdpa",
            "malloc_env": MALLOC_ENV, "configs": rows, "not_runnable": NOT_RUNNABLE, **scores(rows)}


def scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`max_relative_error_real_model` (worst |predicted - measured| / measured) and
    `max_underprediction_real_model` (worst (measured - predicted) / measured where the measured peak exceeds the
    prediction, 0 if none: what crashes a run), over every rank of every scored row; and the same under-prediction
    against what the selector's fit checks keep, `learnt_reserve`'s."""
    rows = [r for r in rows if r.get("scored", True)]
    errors = [r["relative_error"] for r in rows if r.get("relative_error") is not None]
    for r in rows:  # a row's relative_error is its worst rank by magnitude; the most under-predicted rank may differ
        errors += [x["relative_error_total"] for x in r.get("ranks", []) if "relative_error_total" in x]
    return {"max_relative_error_real_model": max(map(abs, errors)) if errors else None,
            "max_underprediction_real_model": max([0.0, *(-e for e in errors)]) if errors else None,
            **learnt_reserve(rows)}


def learnt_reserve(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The under-prediction the selector's fit checks would have met, with the reserve it learns from the ranks'
    reported peaks (`supervisor.memory_reserve.LearntReserve`, prior 0 so that only what was learnt counts).

    Contexts grow: a layout is measured at its smaller token counts before its larger ones. So each layout's rows
    (`plan[@shape]`, bf16 its own layout) are replayed in order of tokens: a row is predicted as the model's total
    plus the reserve learnt from that layout's smaller rows (their fullest rank's peak over their prediction), then
    teaches the reserve itself. The first row of a layout has nothing learnt yet (the configured prior,
    `selector.reserve_bytes`, covers it in a run) and is not scored here. `max_underprediction_with_learnt_reserve`:
    the worst (measured - predicted - reserve) / measured over the scored rows' ranks, 0 if none."""
    from earl_stream.supervisor.memory_reserve import LearntReserve

    layouts: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("predicted_total_bytes") and r.get("ranks"):
            layouts.setdefault(r["plan"] + (f"@{r['shape']}" if r.get("shape") else ""), []).append(r)
    reserve, scored, worst = LearntReserve(prior_bytes=0), [], 0.0
    for name, held in layouts.items():
        seen: list[str] = []
        for r in sorted(held, key=lambda r: r["tokens"]):
            peak = max(x["measured_total_bytes"] for x in r["ranks"])
            if seen:
                kept = r["predicted_total_bytes"] + reserve.bytes(name)
                worst = max(worst, (peak - kept) / peak)
                scored.append({"case": r["case"], "learnt_from": list(seen), "reserve_bytes": reserve.bytes(name),
                               "measured_bytes": peak, "relative_error": (kept - peak) / peak})
            reserve.observe(name, r["predicted_total_bytes"], peak)
            seen.append(r["case"])
    return {"max_underprediction_with_learnt_reserve": worst if scored else None, "learnt_reserve_rows": scored}


NOTE = ("Measured on a shared 2-core, 24 GiB host (other work ran beside it: step times are not "
        "comparable; peak RSS is) by bench/memory_model.py --only-real-model, whose runs merge: each row's "
        "`measured_at` names the date and commit whose tree measured it (`grid_run`: the cases held; `last_run`: the "
        "latest invocation's grid and commit). tp2 and sp2 run on `heads8`, SmolLM2-135M's config with 8 attention "
        "and 4 KV heads (SmolLM2's own 9 heads refuse them: `not_runnable`). The totals include ~45-60 MiB per rank "
        "of runtime that the model leaves to the reserve (the states measure 2-5% above weights, gradients and "
        "AdamW in fp32), plus ~15 MiB per rank in the dp2, tp2 and sp2 steps that does not grow with the tokens "
        "(the same at 1K and 2K): together most of every under-prediction, the worst where the total is smallest "
        "(tp2@heads8 at 1K). bf16 states read +5-9% because the model counts autocast's bf16 weight copy (2 bytes/param) "
        "with the weights while the step makes it (under FSDP2 it is a per-layer bf16 gather instead: over-counted "
        "there). The switch row is predicted by supervisor.switch_memory.predict_switch (64 MiB buckets): the new "
        "model's shards are materialised with to_empty and become resident only as the move writes them, which RSS "
        "sees and a CUDA allocator would not. What the selector keeps free is the model's total plus each layout's "
        "reserve learnt from its ranks' peaks (supervisor.memory_reserve): `learnt_reserve_rows` replays each "
        "layout's rows in order of tokens, learning at the smaller and scoring at the larger "
        "(`max_underprediction_with_learnt_reserve`); a layout's first row is covered by the configured prior "
        "(selector.reserve_bytes, 1 GiB by default) and not scored there.")


HOST_FREE_BYTES = 16 << 30  # what the shared 24 GiB host measuring these rows had free, at best


def _not_measured(held: set[str]) -> dict[str, str]:
    """REAL_FULL's cases no held row measured, each with its predicted per-rank total (why a small host skips it)."""
    out = {}
    for item in REAL_FULL:
        if item.startswith("switch:"):
            old, new = item.split(":")[1].split(">")
            if f"switch {old} -> {new}" not in held:
                out[f"switch {old} -> {new}"] = "not run"
            continue
        plan, shape, tokens = parse_case(item)
        if case_name(plan, shape, tokens) in held:
            continue
        total, world = predict(plan, tokens, shape)[2].total_bytes, rank_plan(plan).world
        why = "more than this shared 24 GiB host had free" if total * world > HOST_FREE_BYTES else "not in a grid run"
        out[case_name(plan, shape, tokens)] = f"predicted {total / 2**30:.1f} GiB per rank x {world} ranks: {why}"
    return out


def merge(old: dict[str, Any], new: dict[str, Any], grid: list[str], at: str) -> dict[str, Any]:
    """(f) with `new`'s rows (stamped `measured_at` = `at`) replacing `old`'s rows of the same case, the others kept
    in place, new cases appended; the scores, `grid_run`, `not_measured` and the note recomputed over every row."""
    fresh = {r["case"]: {**r, "measured_at": at} for r in new["configs"]}
    rows = [fresh.pop(r["case"], r) for r in old.get("configs", [])] + list(fresh.values())
    held = [r["case"] for r in rows if "not_runnable" not in r]
    keep = {k: v for k, v in old.items() if k not in new and k not in ("grid_run", "not_measured", "note", "last_run")}
    return {**keep, **new, "shapes": SHAPES, "configs": rows, **scores(rows), "note": NOTE, "grid_run": held,
            "last_run": {"measured_at": at, "grid": grid}, "not_measured": _not_measured(set(held))}
