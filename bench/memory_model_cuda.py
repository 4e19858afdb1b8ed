"""The memory model on a CUDA GPU: part (e) of `bench/memory_model.py`'s results.

    python bench/memory_model_cuda.py [--quick] [--json bench/results/memory_model.json]

Real model shapes (SmolLM2-135M, Qwen2.5-0.5B) at 1,024-8,192 tokens, fp32 and bf16 autocast, flash
(sdpa) and eager attention, with and without full recomputation: one GRPO training step each in a fresh
process (`memory_model.child` with `device=cuda`). Measured with the CUDA caching allocator's own
counters, exact to its 512-byte rounding: the step's peak (`max_memory_allocated`) with weights,
gradients and AdamW states allocated, against the model's `total_bytes` (states + step); and the
step's part above the states against `dynamic_bytes`. Each row is predicted twice: with the attention
the config names, and with the kernel torch really ran ("as run"): fp32 `sdpa` with grouped KV heads
falls back to SDPA's math path, which stores the s x s scores like eager attention (no flash kernel
takes fp32; the memory-efficient one does not take grouped heads). Writes the "cuda" key of the
results file, keeping the CPU parts (a)-(d) there. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_model import SMOLLM2, run_child  # noqa: E402

from earl_stream.supervisor.memory_model import (  # noqa: E402
    LOGIT_COPIES_EARL_GRPO,
    Attention,
    ModelShape,
    Precision,
    Recompute,
    TrainPlan,
    predict_train_memory,
)

QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 32768}
# (model, seq_len, micro_batch, dtype, attention, full recomputation)
CUDA_GRID = [("smollm2", 1024, 1, "fp32", "sdpa", False), ("smollm2", 4096, 1, "fp32", "sdpa", False),
             ("smollm2", 4096, 1, "bf16", "sdpa", False), ("smollm2", 4096, 1, "bf16", "sdpa", True),
             ("smollm2", 2048, 1, "fp32", "eager", False), ("smollm2", 8192, 1, "bf16", "sdpa", False),
             ("qwen05b", 1024, 1, "fp32", "sdpa", False), ("qwen05b", 4096, 1, "bf16", "sdpa", False),
             ("qwen05b", 8192, 1, "bf16", "sdpa", False), ("qwen05b", 8192, 1, "bf16", "sdpa", True),
             ("qwen05b", 2048, 2, "bf16", "eager", False), ("qwen05b", 4096, 1, "fp32", "sdpa", True)]
CUDA_QUICK = CUDA_GRID[:2]


def _predict(shape: ModelShape, s: int, b: int, dtype: str, attention: Attention, ckpt: bool) -> object:
    plan = TrainPlan(micro_batch=b, seq_len=s, attention=attention, logit_copies=LOGIT_COPIES_EARL_GRPO,
                     recompute=Recompute.FULL if ckpt else Recompute.NONE,
                     precision=Precision.AUTOCAST_BF16 if dtype == "bf16" else Precision.FP32)
    return predict_train_memory(shape, plan)


def part_e(grid: list) -> dict:
    import torch
    from transformers import LlamaConfig, Qwen2Config

    models = {"smollm2": ("llama", SMOLLM2, LlamaConfig), "qwen05b": ("qwen2", QWEN25_05B, Qwen2Config)}
    rows = []
    for name, s, b, dtype, attn, ckpt in grid:
        arch, config, hf_config = models[name]
        spec = {"model": name, "arch": arch, "config": config, "attn": attn, "loss": "grpo", "seq_len": s,
                "micro_batch": b, "ckpt": ckpt, "dtype": dtype, "device": "cuda"}
        got = run_child(spec)
        shape = ModelShape.from_hf(hf_config(**config))
        named = Attention.EAGER if attn == "eager" else Attention.FLASH
        math_path = attn == "sdpa" and dtype == "fp32"
        bd = _predict(shape, s, b, dtype, named, ckpt)
        as_run = _predict(shape, s, b, dtype, Attention.EAGER if math_path else named, ckpt)
        measured = got["measured_total_bytes"]
        row = {**{k: v for k, v in spec.items() if k != "config"}, "predicted_total_bytes": bd.total_bytes,
               "predicted_bytes": bd.dynamic_bytes, **got,
               "relative_error_total": (bd.total_bytes - measured) / measured,
               "relative_error": (bd.dynamic_bytes - got["measured_bytes"]) / got["measured_bytes"],
               "attention_kernel_run": "math (s x s scores)" if math_path else named.value,
               "relative_error_total_as_run": (as_run.total_bytes - measured) / measured,
               "predicted_peak_phase": bd.peak_phase.value}
        rows.append(row)
        print(f"  {name:8s} {dtype} {attn:5s} s={s:5d} b={b} recompute={int(ckpt)}: measured {measured / 2**30:6.2f} GiB, "
              f"predicted {bd.total_bytes / 2**30:6.2f} ({row['relative_error_total']:+.3f}), as run "
              f"{as_run.total_bytes / 2**30:6.2f} ({row['relative_error_total_as_run']:+.3f}); {got['step_seconds']:.2f} s",
              flush=True)
    as_run_errors = [abs(r["relative_error_total_as_run"]) for r in rows]
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "configs": rows, "max_relative_error_total": max(abs(r["relative_error_total"]) for r in rows),
            "max_relative_error_step": max(abs(r["relative_error"]) for r in rows),
            "max_relative_error_total_as_run": max(as_run_errors), "min_relative_error_total_as_run": min(as_run_errors),
            "max_relative_error_total_as_run_without_recompute": max(
                abs(r["relative_error_total_as_run"]) for r in rows if not r["ckpt"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/memory_model.json", help="results file whose 'cuda' key is written")
    ap.add_argument("--quick", action="store_true", help="two configurations")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("memory_model_cuda: torch sees no CUDA device here; this part needs one", file=sys.stderr)
        return 2
    out = Path(args.json)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["cuda"] = part_e(CUDA_QUICK if args.quick else CUDA_GRID)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    c = result["cuda"]
    print(f"as run: max error {c['max_relative_error_total_as_run']:.3f} (without recomputation "
          f"{c['max_relative_error_total_as_run_without_recompute']:.3f}); wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
