"""The selector's step cost model calibrated for one model on this machine's trainer pool: the file that
`selector.cost_model_path` reads.

    python bench/cost_calibration.py --model-dir DIR --json cost_model.json [--layouts dp2,fsdp2,tp2,sp2]

The selector ranks the plans that fit by a `StepCostModel` (FLOPs, bytes moved, collective calls, per
micro-batch and per step constants). Its defaults describe a GPU node; on other hardware a user calibrates
it once, as here. Two gloo ranks each load the model (`from_pretrained(DIR)`, fp32, the attention
implementation of --attention) and train through the trainer's own code (`workers.sharding.shard_model` /
`relayout` / `apply_plan`, `workers.train_step.train_step`, AdamW) synthetic episodes under every layout
of --layouts, with and without recomputation: steps of one and of two one-row micro-batches of --short
tokens, and of one of --long tokens (4x longer by default: compute is told from constant costs, one
micro-batch from two tells a step's constant from a micro-batch's). One round over the configurations warms
up, then --rounds more are measured (interleaved: a load drift hits every configuration alike) and each
configuration's median is kept. `StepCostModel.fit_steps` (relative errors: short steps count as much as
long ones) fits those medians.

Seconds are wall seconds of the pool (the slower rank's step): what a training step costs the run, a rank's
waits in collectives for its peer included (CPU seconds, also recorded, leave them out; on the 8-head
real-scale model here wall was 5-12% above CPU).

The JSON holds `cost_model` (load it with `selector.cost_model_path=<this file>`), the measured and fitted
seconds of every configuration (`calibration`), the fit's mean and largest relative error, the model and
layouts, and the seconds the calibration took.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from selector import MALLOC_ENV, Rank, _claim, _status, configurations  # noqa: E402  (bench/, beside this script)

from bench.provenance import write_result  # noqa: E402

WORLD = 2
ATTENTION = {"sdpa": "flash", "eager": "eager"}  # transformers' attn_implementation -> the memory model's Attention


class ModelRank(Rank):
    """A trainer rank of the calibration pool: the model of --model-dir, no memory cap."""

    def __init__(self, rank: int, port: int, model_dir: str, attention: str) -> None:  # noqa: D107
        import torch
        from transformers import AutoModelForCausalLM

        from bench.ranks import join
        from earl_stream.workers.mesh import TrainerMesh

        join(rank, WORLD, port)
        self.rank, self.mesh = rank, TrainerMesh(WORLD, rank, torch.device("cpu"))
        self.base_vm, self.base_rss = _status("VmData:"), _status("VmRSS:")
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention,
                                                               dtype=torch.float32)
        self.model.config.use_cache = False
        self.model.train()
        self.optimizer: Any = None
        self.placement: Any = None


def rank_main(args: argparse.Namespace) -> None:
    """A warm-up round over the configurations, then --rounds measured ones; their steps, as one JSON line."""
    from bench.ranks import rank_plan

    me = ModelRank(args.rank, args.port, args.model_dir, args.attention)
    vocab = int(me.model.config.vocab_size)
    todo, records = configurations(args.layouts.split(","), args.short, args.long), []
    for k, (layout, s, rc, mbs) in enumerate(todo * (1 + args.rounds)):
        plan = rank_plan(layout)
        me.adopt(dataclasses.replace(plan, recompute=rc, micro_batch_tokens=s // plan.sp))  # one row per micro-batch
        metas, puller = _claim(20_000 + k, [s] * (plan.data_ranks * mbs), vocab=vocab)
        rec = me.step(metas, puller)
        if k >= len(todo):
            records.append({"rank": me.rank, "round": k // len(todo), "layout": layout, "seq_len": s, "recompute": rc, "micro_batches": mbs,
                            **rec})
    print(json.dumps({"rank": me.rank, "steps": records}), flush=True)


def fit(model_dir: str, attention: str, measured: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The cost model fitted on the pool's wall seconds of each configuration (the median over the rounds of
    the slower rank's), and each configuration's measured (wall and CPU) and fitted seconds."""
    from bench.ranks import rank_plan
    from earl_stream.supervisor.cost_model import StepCostModel
    from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_GRPO, Attention, ModelShape, Recompute, TrainPlan

    shape = ModelShape.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    keys = list(dict.fromkeys((x["layout"], x["seq_len"], x["recompute"], x["micro_batches"]) for x in measured))
    rows, samples = [], []
    for layout, s, rc, mbs in keys:
        ranks = [x for x in measured if (x["layout"], x["seq_len"], x["recompute"], x["micro_batches"]) == (layout, s, rc, mbs)]
        p = rank_plan(layout)
        plan = TrainPlan(1, s, dp=p.data_ranks, tp=p.tp, sp=p.sp, fsdp=p.fsdp > 1, attention=Attention(ATTENTION[attention]),
                         recompute=Recompute.FULL if rc else Recompute.NONE, logit_copies=LOGIT_COPIES_EARL_GRPO)
        rounds = sorted({x["round"] for x in ranks})
        wall = median(max(x["wall_seconds"] for x in ranks if x["round"] == k) for k in rounds)
        cpu = median(max(x["cpu_seconds"] for x in ranks if x["round"] == k) for k in rounds)
        samples.append((shape, [plan] * mbs, wall))
        rows.append({"layout": layout, "seq_len": s, "recompute": rc, "micro_batches": mbs, "wall_seconds": round(wall, 4),
                     "cpu_seconds": round(cpu, 4), "rounds": len(rounds)})
    model = StepCostModel.fit_steps(samples, relative=True)
    for r, (_, plans, _) in zip(rows, samples):
        r["predicted_seconds"] = round(model.predict_step(shape, plans), 4)
    return model.to_dict(), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="a model directory (config.json and weights)")
    ap.add_argument("--json", required=True, help="where to write the calibration (selector.cost_model_path reads it)")
    ap.add_argument("--layouts", default="dp2,fsdp2,tp2,sp2",
                    help="comma-separated layouts of the 2-rank pool to measure (tp2 and sp2 need heads divisible by 2)")
    ap.add_argument("--attention", choices=tuple(ATTENTION), default="sdpa", help="transformers' attention implementation")
    ap.add_argument("--short", type=int, default=128, help="tokens per row of the short steps")
    ap.add_argument("--long", type=int, default=512, help="tokens per row of the long steps")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds after the warm-up (each configuration's median)")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=WORLD, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank >= 0:
        rank_main(args)
        return 0
    from bench.ranks import launch

    start = time.monotonic()
    ranks = launch(__file__, list(argv if argv is not None else sys.argv[1:]), WORLD, env=MALLOC_ENV, timeout_s=3600.0)
    measured = [x for r in ranks for x in r["steps"]]
    cost_model, rows = fit(args.model_dir, args.attention, measured)
    errors = [abs(r["predicted_seconds"] - r["wall_seconds"]) / r["wall_seconds"] for r in rows]
    for r in rows:
        print(f"  {r['layout']:6s} s={r['seq_len']:4d} recompute={int(r['recompute'])} mbs={r['micro_batches']}: "
              f"{r['wall_seconds'] * 1e3:8.1f} ms wall ({r['cpu_seconds'] * 1e3:8.1f} ms CPU), "
              f"{r['predicted_seconds'] * 1e3:8.1f} ms fitted")
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    result = {"cost_model": cost_model, "calibration": rows, "time": "wall seconds of the pool (the slower rank)",
              "fit_mean_relative_error": round(sum(errors) / len(errors), 4),
              "fit_max_relative_error": round(max(errors), 4),
              "model": {k: config.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                  "num_key_value_heads", "intermediate_size", "vocab_size")},
              "attention": args.attention, "layouts": args.layouts.split(","), "world": WORLD,
              "seconds": round(time.monotonic() - start, 1)}
    write_result(Path(args.json), result, indent=1)
    print(f"cost model {cost_model}\nfit relative error mean {result['fit_mean_relative_error']}, max "
          f"{result['fit_max_relative_error']}; wrote {args.json} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
