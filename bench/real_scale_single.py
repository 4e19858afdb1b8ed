"""One trainer rank, contexts that grow 16x: a static plan against the selector's plan, on one device.

    python bench/real_scale_single.py --device cuda --dtype bf16 --cap-gib 24 --json bench/results/real_scale_gpu.json

The single-rank form of bench/real_scale.py: what happens to the trainer of one
device when the episodes it trains grow from 1K to 16K tokens (--lengths), under a real memory cap
(--cap-gib: on CUDA `torch.cuda.set_per_process_memory_fraction`, so that an allocation past it is
the CUDA allocator's own OutOfMemoryError; on CPU RLIMIT_DATA). Each phase trains --steps steps of
--rows sequences of its length with the real `workers.train_step` (packed micro-batches, the trainer's
placement, AdamW, bf16 autocast) in a fresh process per strategy:
- static: the plan the selector picks for the first phase (micro-batch token budget, recomputation),
  kept for the whole run, as a run configured once at its start;
- adaptive: the selector re-picks the plan for each phase's design length (`TrainerSelector.plan_for`,
  the same memory model and cost model the supervisor uses).
Both strategies run the same rows (seeded) and the same steps. The model is SmolLM2-135M's
architecture (--model DIR loads any Hugging Face causal LM directory instead): without --model its
weights are random (the imported SmolLM2 weights do not travel to a lent GPU host), which changes
neither memory nor speed. The rows are held in this process and served through the store's Puller
interface (the data plane is not what this measures). Per phase and strategy the JSON records the plan,
trained tokens/s, the measured peak (CUDA allocator peak / RSS high-water) against the memory model's
prediction, and whether the phase crashed with a real allocation failure; `vs_static` is the adaptive
tokens/s over the static plan's in each phase both survived.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402

GIB = 1 << 30
# SmolLM2-135M-Instruct's architecture (HuggingFaceTB/SmolLM2-135M-Instruct config.json)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, hidden_act="silu", rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def build_model_dir(out: Path, max_len: int, tiny: bool) -> Path:
    """A Hugging Face directory of SmolLM2-135M's architecture (random weights), or a tiny one for a CPU check."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(SMOLLM2_135M)
    if tiny:
        kw.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    config = LlamaConfig(max_position_embeddings=max(max_len, 8192), **kw)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def claim(rows: int, length: int, vocab: int, seed: int) -> tuple[list[Any], dict[str, np.ndarray]]:
    """`rows` sequences of `length` tokens (4 groups); the model's turns (loss mask) are 64-token replies after
    every 448 tokens of observation, as in a multi-turn episode; behaviour log-probs near a uniform policy's."""
    from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, sample_key

    rng = np.random.default_rng(seed)
    metas, data = [], {}
    for i in range(rows):
        ids = rng.integers(5, vocab, size=length, dtype=np.int32)
        mask = ((np.arange(length) % 512) >= 448).astype(np.uint8)
        mask[:16] = 0
        blp = (np.full(length, -math.log(vocab)) * mask).astype(np.float32)
        sid = f"r{seed}_{i}"
        data[sample_key(sid, "input_ids")], data[sample_key(sid, "loss_mask")] = ids, mask
        data[sample_key(sid, "behaviour_logprobs")] = blp
        metas.append(SampleMeta(schema_version=SCHEMA_VERSION, sample_id=sid, prompt_ordinal=i // 4, episode_id=sid,
                                group_id=f"g{seed}_{i // 4}", env="synthetic", turns=length // 512 + 1,
                                prompt_tokens=16, response_tokens=int(mask.sum()), total_tokens=length,
                                reward=float(rng.random()), advantage=None, policy_version_min=0,
                                policy_version_max=0, producer_id="p", producer_address="local", checksum=0,
                                created_at=0.0, info_json="{}"))
    return metas, data


def selector_for(model_dir: Path, cap: int, reserve: int, dtype: str, rows: int, attention: str) -> Any:
    from earl_stream.supervisor.decisions import DTYPE_PRECISION
    from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_VOCAB_PARALLEL, Attention, TrainPlan
    from earl_stream.supervisor.model_shape import ModelShape
    from earl_stream.supervisor.selector import PoolBudget, Thresholds, TrainerSelector

    shape = ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))
    base = TrainPlan(micro_batch=1, seq_len=256, attention=Attention(attention), precision=DTYPE_PRECISION[dtype],
                     logit_copies=LOGIT_COPIES_EARL_VOCAB_PARALLEL)
    # the supervisor's thresholds, with a window and cool-down of one phase (--rows episodes)
    thresholds = Thresholds(min_episodes=rows, min_episodes_between=rows)
    return TrainerSelector(shape, PoolBudget(1, cap, reserve), base=base, thresholds=thresholds, allow_tp=False,
                           allow_sp=False, allow_fsdp=False, step_sequences=rows, max_micro_batch_tokens=1 << 20)


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_strategy(args: argparse.Namespace, strategy: str, model_dir: Path) -> dict[str, Any]:
    """Every phase of one strategy in this process; stops at the first allocation failure."""
    from transformers import AutoModelForCausalLM

    from earl_stream.config import TrainerConfig
    from earl_stream.devices import resolve_device
    from earl_stream.store.experience import InProcessPuller
    from earl_stream.supervisor.context_stats import ContextStats
    from earl_stream.supervisor.memory_model import predict_train_memory
    from earl_stream.supervisor.selector import Thresholds
    from earl_stream.workers.mesh import RankPlan, TrainerMesh
    from earl_stream.workers.sharding import apply_plan
    from earl_stream.workers.train_step import train_step

    device = resolve_device(args.device)
    cap, reserve = int(args.cap_gib * GIB), int(args.reserve_gib * GIB)
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(device).total_memory),
                                                   device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    if device.type != "cuda":  # the cap counts from what the loaded model already holds
        held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (held + cap, resource.RLIM_INFINITY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    selector = selector_for(model_dir, cap, reserve, args.dtype, args.rows, args.attention)
    decision = selector.initial(Thresholds().design_seq_len(args.lengths[0]))
    if not hasattr(decision, "plan"):
        return {"strategy": strategy, "phases": [{"length": args.lengths[0], "crashed": False,
                                                  "refused": decision.message}], "crashed": False, "refused": True}
    stats = ContextStats(4 * args.rows)
    phases = []
    for length in args.lengths:
        phase: dict[str, Any] = {"length": length, "crashed": False}
        if strategy == "adaptive":  # the supervisor's path: the finished episodes' lengths, then decide()
            stats.add_many([length] * args.rows)
            new = selector.decide(stats.snapshot(), step=len(phases))
            if new is not None and not hasattr(new, "plan"):
                phase["infeasible"] = new.message  # the supervisor keeps the current plan
            elif new is not None:
                decision = new
        plan = RankPlan(micro_batch_tokens=decision.micro_batch_tokens, recompute=decision.plan.recompute.value != "none",
                        dtype=args.dtype)
        placement = TrainerMesh(1, 0, device).placement(plan)
        apply_plan(model, placement)
        cfg = TrainerConfig(micro_batch_tokens=plan.micro_batch_tokens, dtype=args.dtype)
        phase.update(plan={"micro_batch_tokens": plan.micro_batch_tokens, "recompute": plan.recompute,
                           "packing": getattr(cfg, "packing", False), "version": decision.version},
                     predicted_peak_bytes=decision.predicted_peak_bytes, reason=decision.reason)
        # the largest micro-batch this phase materialises (rows of one length: k rows of `length` tokens)
        per_mb = max(1, min(args.rows, plan.micro_batch_tokens // length)) * length
        phase["predicted_micro_batch_peak_bytes"] = predict_train_memory(
            selector.shape, dataclasses.replace(decision.plan, micro_batch=1, seq_len=per_mb)).total_bytes
        if not phases:  # one untimed step first: CUDA context, kernels and allocator warm-up
            metas, rows = claim(2, 256, model.config.vocab_size, seed=1)
            train_step(model, optimizer, metas, placement.layout, InProcessPuller(rows), cfg, placement=placement)
        tokens, seconds, peaks = 0, 0.0, []
        try:
            for step in range(args.steps):
                metas, rows = claim(args.rows, length, model.config.vocab_size, seed=1000 * length + step)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.monotonic()
                res = train_step(model, optimizer, metas, placement.layout, InProcessPuller(rows), cfg, placement=placement,
                                 step=step)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds += time.monotonic() - start
                tokens += res.tokens
                peaks.append(peak_bytes(device))
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "memory" not in str(exc):
                raise
            phase.update(crashed=True, error=str(exc).splitlines()[0][:300])
            phases.append(phase)
            break
        phase.update(tokens=tokens, seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds, 1),
                     peak_bytes=max(peaks))
        phases.append(phase)
        print(json.dumps({"strategy": strategy, **phase}), file=sys.stderr, flush=True)
    return {"strategy": strategy, "phases": phases, "crashed": any(p["crashed"] for p in phases),
            "refused": any("refused" in p for p in phases)}


def summarise(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    static, adaptive = (results[k]["phases"] for k in ("static", "adaptive"))
    ratios = {}
    for a in adaptive:
        s = next((p for p in static if p["length"] == a["length"] and "tokens_per_s" in p), None)
        if s is not None and "tokens_per_s" in a:
            ratios[str(a["length"])] = round(a["tokens_per_s"] / s["tokens_per_s"], 3)
    errors = [abs(p["peak_bytes"] - p["predicted_micro_batch_peak_bytes"]) / p["predicted_micro_batch_peak_bytes"]
              for ph in (static, adaptive) for p in ph if "peak_bytes" in p and args.device != "cpu"]  # CPU: RSS
    device = args.device
    if torch.cuda.is_available() and args.device != "cpu":
        device = torch.cuda.get_device_name()
    return {"what": "bench/real_scale_single.py: one trainer rank, contexts growing "
                    f"{args.lengths[0]} -> {args.lengths[-1]} tokens, static plan vs the selector's",
            "device": device, "torch": torch.__version__, "dtype": args.dtype, "cap_bytes": int(args.cap_gib * GIB),
            "reserve_bytes": int(args.reserve_gib * GIB), "rows_per_step": args.rows, "steps_per_phase": args.steps,
            "lengths": args.lengths,
            "model": args.model or ("tiny Llama (--tiny)" if args.tiny else "SmolLM2-135M architecture, random weights"),
            "static_crashed": results["static"]["crashed"], "adaptive_crashed": results["adaptive"]["crashed"],
            "static_crashed_at": next((p["length"] for p in static if p["crashed"]), None),
            "vs_static": ratios, "max_relative_error_peak": round(max(errors), 4) if errors else None,
            "static": static, "adaptive": adaptive,
            "context_growth": args.lengths[-1] / args.lengths[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when torch sees one)")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"), help="trainer compute precision")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="memory cap of the rank (GiB), also the selector's budget")
    ap.add_argument("--reserve-gib", type=float, default=1.0, help="what the selector keeps free inside the cap (GiB)")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="tokens per sequence of each phase")
    ap.add_argument("--rows", type=int, default=8, help="sequences per step")
    ap.add_argument("--steps", type=int, default=2, help="steps per phase")
    ap.add_argument("--attention", default="flash", choices=("flash", "eager"),
                    help="how the selector sizes attention (flash: SDPA/flash kernels, no s x s scores)")
    ap.add_argument("--model", default="", help="a Hugging Face causal LM directory (default: SmolLM2-135M's "
                                                "architecture with random weights)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (a quick CPU check of this script)")
    ap.add_argument("--json", default="", help="write the result here")
    ap.add_argument("--strategy", default="", help=argparse.SUPPRESS)  # internal: run one strategy, print JSON
    ap.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    if args.strategy:
        print(json.dumps(run_strategy(args, args.strategy, Path(args.model_dir))), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_model_dir(Path(tmp) / "model", max(args.lengths), args.tiny)
        results = {}
        for strategy in ("static", "adaptive"):
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--strategy", strategy,
                   "--model-dir", str(model_dir)]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if proc.returncode != 0:  # a crash the process could not catch (e.g. the kernel's OOM killer)
                results[strategy] = {"strategy": strategy, "phases": [{"length": None, "crashed": True,
                                                                       "error": f"exit code {proc.returncode}"}],
                                     "crashed": True, "refused": False}
            else:
                results[strategy] = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = summarise(args, results)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("static", "adaptive")}, indent=1))
    if args.json:
        write_result(Path(args.json), summary, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
