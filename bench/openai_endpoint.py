"""Benchmark: the OpenAI-compatible endpoint against the built-in agent loop on the same multi-turn games.

Both play the same episodes (Tic-Tac-Toe: ~2 tokens a turn, the worst case for per-request overhead;
the calculator tool task: up to 96 tokens a turn; N concurrent) with the
same engine, batcher and sampling (temperature 1) in one process, as a rollout worker does:

- builtin:  `agent_loop.play_episode`, token in / token out, no HTTP.
- endpoint: the same game written as an OpenAI-API agent (`EnvAsAgent`): every turn is a
            `chat.completions.create` of the real `openai` client over HTTP on loopback, the
            conversation re-sent in full; the endpoint matches it to the episode's tokens, renders and
            tokenises only the new messages, and the episode becomes a sample (`play_agent_episode`).
            The agent runs in an agent process, as in a rollout worker by default
            (`rollout.agent_processes=1`): the client's Python is off the engine's event loop.
- endpoint_inprocess: the same, the agent in the engine's event loop (`rollout.agent_processes=0`).

Measured: generated tokens per second of wall time for the whole workload (and episodes/s); the
median over repetitions, the modes alternating (the machine is shared). With an agent process the
endpoint mode uses a second core where there is one (the built-in loop cannot: it is one event loop). The goal: the
endpoint costs at most 20% tokens/s. Prefix mismatches are counted (must be 0).

    nice -n 10 python bench/openai_endpoint.py [--quick] [--episodes 32] [--reps 3] [--json PATH]
    python bench/openai_endpoint.py --models smollm2 --envs tictactoe --json bench/results/openai_endpoint_smollm2.json

The embedded model's replies cost ~1 ms a token, so on 2-token turns a request's fixed cost (HTTP, the `openai`
client's Python) is most of a turn: the worst case. `--models smollm2` runs the same games on a real model
(SmolLM2-135M-Instruct, imported by `make real-model`), whose tokens cost what a user's do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402
from earl_stream.env import make_env  # noqa: E402
from earl_stream.env.agent import EnvAsAgent  # noqa: E402
from earl_stream.model import cache_dir, ensure_default_model, init_model, load_model  # noqa: E402
from earl_stream.model.chat import ChatFormat  # noqa: E402
from earl_stream.openai_api import OpenAIEndpoint  # noqa: E402
from earl_stream.openai_api.http import bind_socket  # noqa: E402
from earl_stream.progress import progress  # noqa: E402
from earl_stream.records import SampleRecord  # noqa: E402
from earl_stream.workers.agent_episode import play_agent_episode  # noqa: E402
from earl_stream.workers.agent_loop import Sampling, episode_sample_seed, play_episode  # noqa: E402
from earl_stream.workers.agent_runner import AgentRunners  # noqa: E402
from earl_stream.workers.engines.batcher import AsyncBatcher  # noqa: E402
from earl_stream.workers.engines.torch_engine import TorchEngine  # noqa: E402

ENVS = ("tictactoe", "calculator")
MODES = ("builtin", "endpoint", "endpoint_inprocess")


async def _round(env: str, mode: str, episodes: int, rep: int, batcher: AsyncBatcher, endpoint: OpenAIEndpoint,
                 chat: ChatFormat, tokenizer: Any, runners: AgentRunners) -> dict[str, Any]:
    seeds = [rep * 10_000 + i for i in range(episodes)]
    start = time.perf_counter()
    records: list[SampleRecord]
    if mode == "builtin":
        records = await asyncio.gather(*[
            play_episode(make_env(env), None, chat, batcher, env_name=env, seed=s, prompt_ordinal=s, group_id=f"g{s}",
                         sampling=Sampling(), policy_version=lambda: 0, decode=tokenizer.decode,
                         sample_seed=episode_sample_seed(s, 0)) for s in seeds])
    else:
        agent = EnvAsAgent(env)
        records = [r for samples in await asyncio.gather(*[
            play_agent_episode(agent, endpoint, api_key="bench", env_name=env, seed=s, prompt_ordinal=s,
                               group_id=f"g{s}", runner=runners if mode == "endpoint" else None,
                               spec=("env_agent", {"env": env})) for s in seeds]) for r in samples]
    seconds = time.perf_counter() - start
    generated = sum(r.response_tokens for r in records)
    return {"env": env, "mode": mode, "rep": rep, "seconds": seconds, "episodes": len(records), "generated_tokens": generated,
            "context_tokens": sum(r.num_tokens for r in records), "turns": sum(r.turns for r in records),
            "tokens_per_s": generated / seconds, "episodes_per_s": len(records) / seconds,
            "prefix_mismatches": sum(int(r.info.get("prefix_mismatches", 0)) for r in records)}


def _model_dir(which: str) -> Path:
    if which == "default":
        return ensure_default_model()
    if which == "smollm2":  # a real model's per-token cost (imported once by `make real-model`)
        path = cache_dir() / "models" / "smollm2-135m-instruct"
        if not (path / "config.json").exists():
            raise SystemExit(f"--models smollm2: no imported model at {path}; run `make real-model` first")
        return path
    return init_model(Path(tempfile.mkdtemp(prefix="earl-bench-")) / "random", seed=0)


async def _run(which: str, envs: list[str], modes: tuple[str, ...], episodes: int, reps: int, threads: int,
               agent_processes: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, tokenizer = load_model(_model_dir(which))
    chat = ChatFormat(tokenizer)
    batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
    endpoint = OpenAIEndpoint(batcher, tokenizer, chat, model="policy", secret=b"bench", max_context=4096,
                              default_max_tokens=32)
    await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
    runners = AgentRunners(agent_processes, "bench")
    out: dict[str, Any] = {}
    try:
        with progress(f"openai_endpoint {which}", len(envs) * reps * len(modes), "rounds") as bar:
            for env in envs:
                for mode in modes:  # warm-up: every path once
                    await _round(env, mode, 4, 99, batcher, endpoint, chat, tokenizer, runners)
                rows = []
                for rep in range(reps):
                    for mode in (modes if rep % 2 == 0 else modes[::-1]):
                        row = await _round(env, mode, episodes, rep, batcher, endpoint, chat, tokenizer, runners)
                        rows.append(row)  # every round is in the result; the bar shows the latest
                        bar.advance(note=f"{env} {mode} rep {rep}: {row['tokens_per_s']:.1f} tok/s, "
                                         f"{row['episodes_per_s']:.2f} episodes/s")
                out[env] = _summarise(rows, modes)
    finally:
        await runners.aclose()
        await endpoint.close()
        await batcher.aclose()
    return out


def _summarise(rows: list[dict[str, Any]], modes: tuple[str, ...]) -> dict[str, Any]:
    """Medians per mode, and the endpoint's ratio per repetition (its round beside the built-in round of the same rep,
    which ran next to it, so a slow spell of the shared machine hits both)."""
    summary: dict[str, Any] = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                         "episodes_per_s": statistics.median(r["episodes_per_s"] for r in mine),
                         "tokens_per_turn": sum(r["generated_tokens"] for r in mine) / sum(r["turns"] for r in mine),
                         "tokens_per_s_all_reps": [round(r["tokens_per_s"], 1) for r in mine],
                         "prefix_mismatches": sum(r["prefix_mismatches"] for r in mine)}
    ratio = summary["endpoint"]["tokens_per_s"] / summary["builtin"]["tokens_per_s"]
    by_rep = {(r["mode"], r["rep"]): r["tokens_per_s"] for r in rows}
    paired = [round(by_rep["endpoint", rep] / by_rep["builtin", rep], 3) for mode, rep in sorted(by_rep) if mode == "builtin"]
    out = {"summary": summary, "endpoint_over_builtin_tokens_per_s": round(ratio, 3),
           "endpoint_over_builtin_per_rep": paired, "cost_pct": round(100 * (1 - ratio), 1), "goal_met": ratio >= 0.8,
           "rows": rows}
    if "endpoint_inprocess" in summary:
        out["endpoint_inprocess_over_builtin_tokens_per_s"] = round(
            summary["endpoint_inprocess"]["tokens_per_s"] / summary["builtin"]["tokens_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default,random", help="default: the embedded warm-started model (short "
                    "replies); random: a random-init tiny model (replies run to the turn's token limit); smollm2: "
                    "SmolLM2-135M-Instruct from `make real-model` (a real model's cost per token)")
    ap.add_argument("--envs", default=",".join(ENVS), help="comma-separated environments (registry names)")
    ap.add_argument("--episodes", type=int, default=32, help="concurrent episodes per round")
    ap.add_argument("--reps", type=int, default=4, help="rounds per mode (alternating)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rollout worker's default is 1)")
    ap.add_argument("--agent-processes", type=int, default=1, help="agent processes of the endpoint mode "
                    "(rollout.agent_processes; its default is 1)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run (builtin and endpoint "
                    "always run: the ratio is theirs)")
    ap.add_argument("--quick", action="store_true", help="8 episodes, 2 reps")
    ap.add_argument("--json", default="bench/results/openai_endpoint.json", help="where to write the results")
    args = ap.parse_args(argv)
    episodes, reps = (8, 2) if args.quick else (args.episodes, args.reps)
    envs = args.envs.split(",")
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        ap.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    modes = tuple(m for m in MODES if m in {"builtin", "endpoint", *args.modes.split(",")})
    print(f"{envs}: {episodes} concurrent episodes, {reps} reps per mode, {args.threads} torch thread(s)")
    result: dict[str, Any] = {"models": {}, "load_average_at_start": os.getloadavg()}
    for which in args.models.split(","):
        print(f"model: {which}")
        result["models"][which] = asyncio.run(_run(which, envs, modes, episodes, reps, args.threads,
                                                   args.agent_processes))
    print(f"\n{'model':8s} {'env':11s} {'mode':18s} {'tok/s':>8s} {'episodes/s':>11s} {'tok/turn':>9s}")
    for which, per_env in result["models"].items():
        for env, r in per_env.items():
            s = r["summary"]
            for mode in modes:
                print(f"{which:8s} {env:11s} {mode:18s} {s[mode]['tokens_per_s']:8.1f} {s[mode]['episodes_per_s']:11.2f} "
                      f"{s[mode]['tokens_per_turn']:9.1f}")
            print(f"{which:8s} {env:11s} endpoint / builtin tokens/s = {r['endpoint_over_builtin_tokens_per_s']:.3f} "
                  f"(cost {r['cost_pct']}%, goal <= 20%: {'met' if r['goal_met'] else 'MISSED'}); prefix mismatches "
                  f"{s['endpoint']['prefix_mismatches']}; per rep {r['endpoint_over_builtin_per_rep']}"
                  + (f"; agent in the engine's event loop: {r['endpoint_inprocess_over_builtin_tokens_per_s']:.3f}"
                     if "endpoint_inprocess_over_builtin_tokens_per_s" in r else ""))
    result.update({"load_average_at_end": os.getloadavg(), "goal": "endpoint tokens/s >= 0.8 x builtin", "episodes": episodes, "reps": reps,
                   "threads": args.threads, "agent_processes": args.agent_processes, "modes": list(modes), "torch": torch.__version__,
                   "python": platform.python_version(), "cpus": os.cpu_count(), "quick": args.quick,
                   "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
