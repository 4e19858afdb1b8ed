"""Benchmark: what sandboxing untrusted code costs, episodes per second of wall time with `sandbox.mode`
none, process and bwrap, in two arms.

Environment arm (`env`, the arm the goal is set on): a tool-using environment loaded from a file (`arithmetic.py`,
written at start: each step evaluates the arithmetic expression the policy wrote, the code that needs a sandbox), played
by the built-in agent loop on the embedded tiny model, up to 3 turns an episode, `--env-episodes` concurrent
episodes a round. Sandboxed, its `reset`/`step` run in the worker's environment runner (`open_env_runners`), whose child is
started ahead of need (`EnvRunners.check`, as at attach time) and reused by every round of that mode; under none
the environment is made in this process, as the worker makes it. Rounds of a repetition play the same seeds in
every mode (the same sampled tokens, the same steps).

Agent arm (`agent`): the calculator environment (tool calls: the environment evaluates the policy's
expressions) played as an OpenAI-API agent (`env_agent`) by the rollout worker's agent processes, as `up` runs them
(`open_agent_runners`, one agent process, `--episodes` concurrent episodes), against the real endpoint, engine and
`openai` client. Each round starts the worker's agent processes afresh (the sandbox's start-up, ~1.5 s of imports
in every mode, is inside the round's wall time: the worst case; a worker starts them once and reuses them) and
plays `--episodes` episodes; `warm`: the second half of each round's episodes, timed alone.

Both arms run the modes in rotated order each repetition (none, process, bwrap; then process, bwrap, none; ...),
so a slow spell of the shared machine hits all alike. Reported: episodes/s per mode (mean and 95% interval over
the repetitions) and ratios of means with 95% intervals. Keys: `env_arm` (the environment arm: `episodes_per_s`,
`process_vs_none`, `bwrap_vs_none`, its rows); `bwrap_vs_none` (the environment arm's; goal: bwrap >= 0.8 x none);
the agent arm's as before at the top (`episodes_per_s`, `warm_episodes_per_s`, `process_vs_none`,
`*_vs_none_warm`, `rows`, `env`), its bwrap ratio as `agent_bwrap_vs_none`.

    python bench/sandbox.py [--quick] [--env-episodes 128] [--env-reps 5] [--episodes 32] [--reps 3]
                            [--json bench/results/sandbox.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
from bench.stats import mean_ci95, ratio_ci95  # noqa: E402
from earl_stream.config import EnvSpec  # noqa: E402
from earl_stream.config.load import load_config  # noqa: E402
from earl_stream.env import make_env  # noqa: E402
from earl_stream.env.agent import EnvAsAgent  # noqa: E402
from earl_stream.env.tools import with_tools  # noqa: E402
from earl_stream.model import ensure_default_model, load_model  # noqa: E402
from earl_stream.model.chat import ChatFormat  # noqa: E402
from earl_stream.openai_api import OpenAIEndpoint  # noqa: E402
from earl_stream.openai_api.http import bind_socket  # noqa: E402
from earl_stream.sandbox import bwrap_problem  # noqa: E402
from earl_stream.workers.agent_episode import play_agent_episode  # noqa: E402
from earl_stream.workers.agent_loop import Sampling, play_episode  # noqa: E402
from earl_stream.workers.agent_runner import open_agent_runners  # noqa: E402
from earl_stream.workers.engines.batcher import AsyncBatcher  # noqa: E402
from earl_stream.workers.engines.torch_engine import TorchEngine  # noqa: E402
from earl_stream.workers.env_runner import EnvRunners, open_env_runners  # noqa: E402

MODES = ("none", "process", "bwrap")
ENV = "calculator"
TURNS = 3

# the environment arm's environment, loaded from a file as another project's would be
ARITHMETIC = '''
from earl_stream.env import StepResult


def evaluate(expression):
    """The tool: the policy's expression, evaluated (the code a sandbox is for)."""
    if len(expression) > 64 or "**" in expression or "_" in expression:
        raise ValueError("not a short arithmetic expression")
    return eval(expression, {"__builtins__": {}}, {})


class Arithmetic:
    system_prompt = "Write an arithmetic expression whose value is the number asked for."
    max_turn_tokens = 8

    def __init__(self, turns=3):
        self.turns = turns

    def reset(self, seed):
        self.target, self.n = seed % 50, 0
        return f"Make {self.target}."

    def step(self, action_text):
        self.n += 1
        try:
            value = evaluate(action_text.strip())
            said, reward = f"That is {value}.", float(value == self.target)
        except Exception as exc:
            said, reward = f"Not arithmetic ({type(exc).__name__}).", 0.0
        return StepResult(said, reward, reward > 0 or self.n >= self.turns)
'''


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


async def _env_round(mode: str, runners: EnvRunners | None, spec: EnvSpec, episodes: int, rep: int,
                     batcher: AsyncBatcher, tokenizer: Any) -> dict[str, Any]:
    chat, seeds = ChatFormat(tokenizer), range(rep * 10_000, rep * 10_000 + episodes)
    start = time.perf_counter()
    if runners is None:
        envs: list[Any] = [with_tools(make_env(spec.spec, spec.params)) for _ in seeds]
    else:
        envs = await runners.envs(spec, episodes)
    done = await asyncio.gather(*[
        play_episode(env, None, chat, batcher, env_name="arithmetic", seed=s, prompt_ordinal=s, group_id=f"g{s}",
                     sampling=Sampling(), policy_version=lambda: 0, decode=tokenizer.decode, sample_seed=s)
        for env, s in zip(envs, seeds)], return_exceptions=True)
    end = time.perf_counter()
    failed = [d for d in done if isinstance(d, BaseException)]
    if failed:
        raise RuntimeError(f"env {mode}: {len(failed)} episodes failed, e.g. {failed[0]}")
    sandbox = runners.sandbox.mode.value if runners is not None else "none"
    return {"mode": mode, "ran_as": sandbox, "rep": rep, "episodes": len(done), "seconds": end - start,
            "episodes_per_s": len(done) / (end - start), "steps": sum(r.turns for r in done if not isinstance(r, BaseException)),
            "reward": sum(r.reward for r in done if not isinstance(r, BaseException))}


async def _env_arm(episodes: int, reps: int, modes: tuple[str, ...], batcher: AsyncBatcher,
                   tokenizer: Any) -> list[dict[str, Any]]:
    folder = Path(tempfile.mkdtemp(prefix="earl-bench-sandbox-"))
    (folder / "arithmetic.py").write_text(ARITHMETIC)
    spec = EnvSpec(spec=f"{folder}/arithmetic.py:Arithmetic", params={"turns": TURNS})
    runners = {m: open_env_runners(load_config(None, [f"sandbox.mode={m}"]), f"bench-{m}") for m in modes}
    rows = []
    try:
        for mode, boxed in runners.items():  # started ahead of need (at attach), and one warm-up round each
            if boxed is not None:
                await boxed.check(spec)
            await _env_round(mode, boxed, spec, 4, 99, batcher, tokenizer)
        for rep in range(reps):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                row = await _env_round(mode, runners[mode], spec, episodes, rep, batcher, tokenizer)
                rows.append(row)
                print(f"env   rep {rep} {mode:8s} ({row['ran_as']}): {row['episodes_per_s']:.2f} episodes/s, "
                      f"{row['steps']} steps", flush=True)
        starts = {m: sum(r.starts for r in b.runners.values()) for m, b in runners.items() if b is not None}
        assert all(n == 1 for n in starts.values()), f"a child was restarted: {starts}"
    finally:
        for boxed in runners.values():
            if boxed is not None:
                await boxed.aclose()
    return rows


async def _agent_arm(episodes: int, reps: int, modes: tuple[str, ...], endpoint: OpenAIEndpoint) -> list[dict[str, Any]]:
    for mode in modes:  # warm-up: every path once (imports, the engine's first batches)
        await _round(mode, 4, 99, endpoint)
    rows = []
    for rep in range(reps):
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            row = await _round(mode, episodes, rep, endpoint)
            rows.append(row)
            print(f"agent rep {rep} {mode:8s} ({row['ran_as']}): {row['episodes_per_s']:.2f} episodes/s, "
                  f"warm {row['warm_episodes_per_s']:.2f}", flush=True)
    return rows


async def _run(env_arm: tuple[int, int], agent_arm: tuple[int, int],
               modes: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Both arms' rows; each arm's (episodes per round, repetitions)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tokenizer = load_model(ensure_default_model())
    batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
    endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=b"bench",
                              max_context=4096, default_max_tokens=32)
    await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
    try:
        env_rows = await _env_arm(*env_arm, modes, batcher, tokenizer)
        agent_rows = await _agent_arm(*agent_arm, modes, endpoint)
    finally:
        await endpoint.close()
        await batcher.aclose()
    return env_rows, agent_rows


def summarise(rows: list[dict[str, Any]], modes: tuple[str, ...], *, warm: bool = True) -> dict[str, Any]:
    per = {m: [r for r in rows if r["mode"] == m] for m in modes}
    kinds = ("", "warm_") if warm else ("",)
    out: dict[str, Any] = {f"{k}episodes_per_s": {m: mean_ci95([r[f"{k}episodes_per_s"] for r in per[m]])
                                                  for m in modes} for k in kinds}
    for m in modes:
        if m == "none":
            continue
        for k in kinds:
            out[f"{m}_vs_none{'_warm' if k else ''}"] = ratio_ci95([r[f"{k}episodes_per_s"] for r in per[m]],
                                                                 [r[f"{k}episodes_per_s"] for r in per["none"]])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32, help="agent arm: episodes per round (half timed again as `warm`)")
    ap.add_argument("--reps", type=int, default=3, help="agent arm: rounds per mode, in rotated order")
    ap.add_argument("--env-episodes", type=int, default=128, help="environment arm: episodes per round")
    ap.add_argument("--env-reps", type=int, default=5, help="environment arm: rounds per mode, in rotated order")
    ap.add_argument("--quick", action="store_true", help="8 episodes, 2 reps in each arm")
    ap.add_argument("--json", default="bench/results/sandbox.json", help="where to write the results")
    args = ap.parse_args(argv)
    episodes, reps = (8, 2) if args.quick else (args.episodes, args.reps)
    env_episodes, env_reps = (8, 2) if args.quick else (args.env_episodes, args.env_reps)
    modes = MODES if bwrap_problem() is None else MODES[:2]
    if bwrap_problem() is not None:
        print(f"bwrap is not measured: {bwrap_problem()}")
    result: dict[str, Any] = {"load_average_at_start": os.getloadavg()}
    env_rows, agent_rows = asyncio.run(_run((env_episodes, env_reps), (episodes, reps), modes))
    arms = {"env": summarise(env_rows, modes, warm=False), "agent": summarise(agent_rows, modes)}
    result["env_arm"] = {**arms["env"], "rows": env_rows, "turns": TURNS, "episodes": env_episodes, "reps": env_reps,
                         "children": "started ahead of need, reused by every round of their mode"}
    result.update({k: v for k, v in arms["agent"].items() if k != "bwrap_vs_none"})
    if "bwrap" in modes:
        result["agent_bwrap_vs_none"] = arms["agent"]["bwrap_vs_none"]
        result["bwrap_vs_none"] = arms["env"]["bwrap_vs_none"]
        result["goal"] = "environment arm: bwrap episodes/s >= 0.8 x none"
        result["goal_met"] = result["bwrap_vs_none"]["ratio"] >= 0.8
    result.update({"rows": agent_rows, "env": ENV, "episodes": episodes, "reps": reps, "modes": list(modes),
                   "agent_processes": 1, "quick": args.quick, "load_average_at_end": os.getloadavg(),
                   "bwrap": bwrap_problem() or "usable"})
    for arm, out in arms.items():
        for m in modes:
            s = out["episodes_per_s"][m]
            print(f"{arm:5s} {m:8s} {s['mean']:.2f} episodes/s [{s['low']:.2f}, {s['high']:.2f}]")
        for key in [k for k in out if k.endswith("_vs_none")]:
            r = out[key]
            print(f"{arm:5s} {key}: {r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]")
    write_result(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
