"""Benchmark: what `rollout.batch_invariant` costs the built-in engine.

The same GRPO-shaped rollout workload (groups of seeded requests, each group's prompt shared, every sample
exactly `--new-tokens` tokens) through `TorchEngine.generate`, with batch invariance off and on, arms
interleaved, `--repeats` each. Unit: generated tokens per second (wall time of the whole workload). The
result records every repeat, each arm's mean with its 95% interval, and on/off with its interval; it also
checks that the invariant arm's tokens are the same when the workload is split into other batches.

    python bench/batch_invariant.py [--quick] [--json PATH] [--model tiny|DIR]
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import write_result  # noqa: E402
from stats import mean_ci95, ratio_ci95  # noqa: E402

from earl_stream.model import init_model, load_model  # noqa: E402
from earl_stream.progress import progress  # noqa: E402
from earl_stream.workers.engines import GenerateRequest, TorchEngine  # noqa: E402

DEPENDS_ON = ["earl_stream/workers/engines", "bench/batch_invariant.py", "bench/stats.py"]


def workload(groups: int, group_size: int, new_tokens: int, vocab: int) -> list[GenerateRequest]:
    rnd = random.Random(0)
    out = []
    for g in range(groups):
        prompt = [rnd.randrange(4, vocab) for _ in range(rnd.randrange(40, 120))]
        out += [GenerateRequest(prompt, new_tokens, temperature=1.0, seed=1000 * g + i) for i in range(group_size)]
    return out


def run(engine: TorchEngine, reqs: list[GenerateRequest], batch: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens: list[list[int]] = []
    for i in range(0, len(reqs), batch):
        tokens += [list(r.token_ids) for r in engine.generate(reqs[i:i + batch])]
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repeats, fewer groups")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--model", default="tiny", help="tiny (the tests' model, built here) or a model directory")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per arm (interleaved)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.groups = 2, 4
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model != "tiny" else init_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    model, _ = load_model(model_dir)
    model.eval()
    reqs = workload(args.groups, args.group_size, args.new_tokens, int(model.config.vocab_size))
    engines = {"off": TorchEngine(model), "on": TorchEngine(model, batch_invariant=True)}
    total = sum(r.max_new_tokens for r in reqs)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    run(engines["off"], reqs, len(reqs))  # warm-up (allocator, lazy init)
    with progress("batch_invariant", 2 * args.repeats, "runs") as bar:
        for rep in range(args.repeats):
            for arm in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                seconds, _ = run(engines[arm], reqs, len(reqs))
                rates[arm].append(total / seconds)
                bar.advance(note=f"{arm} repeat {rep}: {total / seconds:.0f} tokens/s")
    _, whole = run(engines["on"], reqs, len(reqs))
    _, split = run(engines["on"], reqs, 3)
    result = {
        "benchmark": "batch_invariant", "unit": "generated tokens/s (wall time of the workload)",
        "model": str(args.model), "threads": args.threads, "machine": platform.machine(),
        "workload": {"groups": args.groups, "group_size": args.group_size, "new_tokens": args.new_tokens,
                     "tokens": total},
        "repeats": rates, "off": mean_ci95(rates["off"]), "on": mean_ci95(rates["on"]),
        "on_vs_off": ratio_ci95(rates["on"], rates["off"]),
        "invariant_tokens_equal_in_batches_of_3": whole == split,
    }
    print(f"tokens/s off {result['off']['mean']:.0f} [{result['off']['low']:.0f}, {result['off']['high']:.0f}]  "
          f"on {result['on']['mean']:.0f} [{result['on']['low']:.0f}, {result['on']['high']:.0f}]  on/off "
          f"{result['on_vs_off']['ratio']:.2f} [{result['on_vs_off']['low']:.2f}, {result['on_vs_off']['high']:.2f}]"
          f"  same tokens in other batches: {result['invariant_tokens_equal_in_batches_of_3']}")
    if args.json:
        write_result(args.json, result, DEPENDS_ON)


if __name__ == "__main__":
    main()
