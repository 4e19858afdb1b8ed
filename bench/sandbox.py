"""Benchmark: what sandboxing agent programs costs (issue 51), episodes per second of wall time with
`sandbox.mode` none, process and bwrap.

The workload: the calculator environment (tool calls: the environment evaluates the policy's expressions) played as
an OpenAI-API agent (`env_agent`) by the rollout worker's agent processes, as `up` runs them
(`open_agent_runners`, one agent process, `--episodes` concurrent episodes), against the real endpoint, engine and
`openai` client, on the embedded tiny model. Each round starts the worker's agent processes afresh (the sandbox's
start-up, ~1.5 s of imports in every mode, is inside the round's wall time: the worst case; a worker starts them
once and reuses them) and plays `--episodes` episodes; the modes run in rotated order each repetition (none,
process, bwrap; then process, bwrap, none; ...), so a slow spell of the shared machine hits all alike. Reported:
episodes/s per mode (mean and 95% interval over the repetitions), `bwrap_vs_none` and `process_vs_none` (ratios of
means with 95% intervals), and the same for rounds whose agent process was already running (`warm`: the second
half of each round's episodes, timed alone). Goal: bwrap >= 0.8 x none.

    python bench/sandbox.py [--quick] [--episodes 32] [--reps 3] [--json bench/results/sandbox.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402
from bench.stats import mean_ci95, ratio_ci95  # noqa: E402
from earl_stream.config.load import load_config  # noqa: E402
from earl_stream.env.agent import EnvAsAgent  # noqa: E402
from earl_stream.model import ensure_default_model, load_model  # noqa: E402
from earl_stream.model.chat import ChatFormat  # noqa: E402
from earl_stream.openai_api import OpenAIEndpoint  # noqa: E402
from earl_stream.openai_api.http import bind_socket  # noqa: E402
from earl_stream.sandbox import bwrap_problem  # noqa: E402
from earl_stream.workers.agent_episode import play_agent_episode  # noqa: E402
from earl_stream.workers.agent_runner import open_agent_runners  # noqa: E402
from earl_stream.workers.engines.batcher import AsyncBatcher  # noqa: E402
from earl_stream.workers.engines.torch_engine import TorchEngine  # noqa: E402

MODES = ("none", "process", "bwrap")
ENV = "calculator"


async def _round(mode: str, episodes: int, rep: int, endpoint: OpenAIEndpoint) -> dict[str, Any]:
    cfg = load_config(None, [f"sandbox.mode={mode}", "rollout.agent_processes=1"])
    spec = ("env_agent", {"env": ENV})
    agent = EnvAsAgent(ENV)

    async def play(seeds: range) -> int:
        done = await asyncio.gather(*[
            play_agent_episode(agent, endpoint, api_key="bench", env_name=ENV, seed=s, prompt_ordinal=s,
                               group_id=f"g{s}", runner=runners, spec=spec) for s in seeds], return_exceptions=True)
        failed = [d for d in done if isinstance(d, BaseException)]
        if failed:
            raise RuntimeError(f"{mode}: {len(failed)} episodes failed, e.g. {failed[0]}")
        return len(done)

    start = time.perf_counter()
    runners = await open_agent_runners(cfg, "bench", endpoint)
    try:
        half = episodes // 2
        first = await play(range(rep * 10_000, rep * 10_000 + half))
        warm_start = time.perf_counter()
        second = await play(range(rep * 10_000 + half, rep * 10_000 + episodes))
        end = time.perf_counter()
    finally:
        await runners.aclose()
    sandbox = runners.sandbox.mode.value if runners.sandbox is not None else "none"
    return {"mode": mode, "ran_as": sandbox, "rep": rep, "episodes": first + second, "seconds": end - start,
            "episodes_per_s": (first + second) / (end - start), "warm_seconds": end - warm_start,
            "warm_episodes_per_s": second / (end - warm_start)}


async def _run(episodes: int, reps: int, modes: tuple[str, ...]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tokenizer = load_model(ensure_default_model())
    batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
    endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=b"bench",
                              max_context=4096, default_max_tokens=32)
    await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
    rows = []
    try:
        for mode in modes:  # warm-up: every path once (imports, the engine's first batches)
            await _round(mode, 4, 99, endpoint)
        for rep in range(reps):
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]
            for mode in order:
                row = await _round(mode, episodes, rep, endpoint)
                rows.append(row)
                print(f"rep {rep} {mode:8s} ({row['ran_as']}): {row['episodes_per_s']:.2f} episodes/s, "
                      f"warm {row['warm_episodes_per_s']:.2f}", flush=True)
    finally:
        await endpoint.close()
        await batcher.aclose()
    return rows


def summarise(rows: list[dict[str, Any]], modes: tuple[str, ...]) -> dict[str, Any]:
    per = {m: [r for r in rows if r["mode"] == m] for m in modes}
    out: dict[str, Any] = {"episodes_per_s": {m: mean_ci95([r["episodes_per_s"] for r in per[m]]) for m in modes},
                           "warm_episodes_per_s": {m: mean_ci95([r["warm_episodes_per_s"] for r in per[m]])
                                                   for m in modes}}
    for m in modes:
        if m == "none":
            continue
        out[f"{m}_vs_none"] = ratio_ci95([r["episodes_per_s"] for r in per[m]], [r["episodes_per_s"] for r in per["none"]])
        out[f"{m}_vs_none_warm"] = ratio_ci95([r["warm_episodes_per_s"] for r in per[m]],
                                              [r["warm_episodes_per_s"] for r in per["none"]])
    if "bwrap_vs_none" in out:
        out["goal"] = "bwrap episodes/s >= 0.8 x none"
        out["goal_met"] = out["bwrap_vs_none"]["ratio"] >= 0.8
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32, help="episodes per round (half timed again as `warm`)")
    ap.add_argument("--reps", type=int, default=3, help="rounds per mode, in rotated order")
    ap.add_argument("--quick", action="store_true", help="8 episodes, 2 reps")
    ap.add_argument("--json", default="bench/results/sandbox.json", help="where to write the results")
    args = ap.parse_args(argv)
    episodes, reps = (8, 2) if args.quick else (args.episodes, args.reps)
    modes = MODES if bwrap_problem() is None else MODES[:2]
    if bwrap_problem() is not None:
        print(f"bwrap is not measured: {bwrap_problem()}")
    result: dict[str, Any] = {"load_average_at_start": os.getloadavg()}
    rows = asyncio.run(_run(episodes, reps, modes))
    result.update(summarise(rows, modes))
    result.update({"rows": rows, "env": ENV, "episodes": episodes, "reps": reps, "modes": list(modes),
                   "agent_processes": 1, "quick": args.quick, "load_average_at_end": os.getloadavg(),
                   "bwrap": bwrap_problem() or "usable"})
    for m in modes:
        s = result["episodes_per_s"][m]
        print(f"{m:8s} {s['mean']:.2f} episodes/s [{s['low']:.2f}, {s['high']:.2f}]")
    for key in [k for k in result if k.endswith("_vs_none")]:
        r = result[key]
        print(f"{key}: {r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]")
    write_result(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
