"""bf16 vs fp32 in the built-in engine on a real model: generation speed and the train/inference mismatch.

    python bench/precision.py MODEL_DIR --json bench/results/smollm2_precision.json

The engine (rollout.dtype) samples 8 sequences x 32 tokens at temperature 1 (seeded) from held-out-like
prompts of configs/smollm2_arithmetic.yaml's task; the trainer's fp32 forward then scores the very same
tokens. Reported per dtype: tokens/s of the batch (one thread) and the mean / max |engine - trainer|
log-prob, i.e. how far the behaviour policy is from the one the trainer differentiates.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402
from earl_stream.model import load_model, torch_dtype  # noqa: E402
from earl_stream.model.chat import ChatFormat  # noqa: E402
from earl_stream.workers.engines import GenerateRequest, TorchEngine  # noqa: E402

# the code it measures: the built-in engine and the model (bf16 autocast), as bench/catalog.py names them
DEPENDS_ON = ["earl_stream/workers/engines", "earl_stream/model", "bench/precision.py"]
SYSTEM = "Solve the arithmetic problem. End your reply with the final answer as a number."
SUMS = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (2, 9, 4), (3, 3, 8), (6, 1, 5), (9, 9, 2), (5, 0, 7)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    trainer, tok = load_model(args.model_dir)
    chat = ChatFormat(tok)
    prompts = [chat.first_turn(SYSTEM, f"Calculate {a} + {b} + {c}.") for a, b, c in SUMS]
    out = {}
    for name in ("fp32", "bf16"):
        model = trainer if name == "fp32" else load_model(args.model_dir, dtype=torch_dtype(name))[0]
        engine = TorchEngine(model, max_batch_size=len(prompts))
        reqs = [GenerateRequest(prompt_ids=p, max_new_tokens=args.tokens, temperature=1.0, seed=i)
                for i, p in enumerate(prompts)]
        engine.generate(reqs[:1])  # warm-up
        start = time.perf_counter()
        results = engine.generate(reqs)
        seconds = time.perf_counter() - start
        diffs: list[float] = []
        with torch.no_grad():
            for p, r in zip(prompts, results):
                logits = trainer(input_ids=torch.tensor([p + r.token_ids])).logits[0, len(p) - 1:-1].float()
                ref = torch.log_softmax(logits, -1)[torch.arange(len(r.token_ids)), torch.tensor(r.token_ids)]
                diffs += (torch.tensor(r.logprobs) - ref).tolist()
        d = torch.tensor(diffs).abs()
        n = sum(len(r.token_ids) for r in results)
        out[name] = {"tokens": n, "seconds": round(seconds, 2), "tokens_per_second": round(n / seconds, 1),
                     "mean_abs_logprob_diff": round(float(d.mean()), 5), "max_abs_logprob_diff": round(float(d.max()), 4)}
        print(name, out[name], flush=True)
    if args.json:
        write_result(args.json, out, depends_on=DEPENDS_ON)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
