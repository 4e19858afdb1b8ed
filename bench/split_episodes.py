"""Benchmark: a summarising agent under `rollout.non_append=split` vs `refuse` (the `split` key of
bench/results/weight_swap.json).

The agent is the calculator task's OpenAI-API agent (`earl_stream_envs.calculator_agent`) with `summarize_after=3`: after its
third reply it replaces the conversation with a summary (the question and the calculator results so far), as
long-horizon agents fold their context. That request does not extend what the model saw:

- split:  the episode goes on as a new segment; each segment is a sample (its prompt = what the model was shown,
          its loss mask = the model's tokens in it), all with the episode's reward, group and prompt ordinal.
- refuse: the request is answered 400 (`non_append_history`), the agent fails, the episode is dropped (its group
          would be played again, and again fail).

Part 1 (always): the same episodes (seeds) played through a real endpoint with the built-in engine, in this
process, under each setting: episodes kept, samples, segments, model tokens kept; episodes dropped.
Part 2 (`--train-seconds S`, > 0): `earl-stream up` on the embedded default with the summarising agent as its only
environment, S seconds under each setting: steps trained, samples and episodes trained, segments split, groups
failed (a group is re-issued after its episode fails).

    python bench/split_episodes.py [--episodes 16] [--train-seconds 90] [--model default|smollm2]
    python -c "from bench.split_episodes import run_split; print(run_split(episodes=8))"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = ("split", "refuse")
DEPENDS_ON = ["earl_stream/openai_api", "earl_stream/workers/agent_episode.py", "earl_stream/supervisor/ledger.py",
              "earl_stream/algo/advantages.py", "envs/calculator_agent.py", "bench/split_episodes.py"]


def _model_dir(which: str) -> Path:
    from earl_stream.model import cache_dir, ensure_default_model

    if which == "default":
        return ensure_default_model()
    if which == "smollm2":  # a real model (imported once by `make real-model`)
        path = cache_dir() / "models" / "smollm2-135m-instruct"
        if not (path / "config.json").exists():
            raise SystemExit(f"--model smollm2: no imported model at {path}; run `make real-model` first")
        return path
    raise SystemExit(f"--model must be default or smollm2, got {which!r}")


def _agent_params(summarize_after: int, max_turns: int, max_tokens: int) -> dict[str, int]:
    return {"summarize_after": summarize_after, "max_turns": max_turns, "max_tokens": max_tokens}


async def _play(model_dir: Path, setting: str, episodes: int, params: dict[str, int]) -> dict[str, Any]:
    """`episodes` summarising-agent episodes (seeds 0..episodes-1, concurrent) through an endpoint under `setting`."""
    import torch
    from earl_stream_envs.calculator_agent import CalculatorAgent

    from earl_stream.model import load_model
    from earl_stream.model.chat import ChatFormat
    from earl_stream.openai_api import OpenAIEndpoint
    from earl_stream.openai_api.http import bind_socket
    from earl_stream.workers.agent_episode import play_agent_episode
    from earl_stream.workers.engines.batcher import AsyncBatcher
    from earl_stream.workers.engines.torch_engine import TorchEngine

    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir)
    batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
    endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=None, max_context=4096,
                              default_max_tokens=params["max_tokens"], non_append=setting)
    await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
    agent = CalculatorAgent(**params)
    start = time.perf_counter()
    try:
        played = await asyncio.gather(*[
            play_agent_episode(agent, endpoint, api_key="bench", env_name="calculator_agent", seed=s, prompt_ordinal=s,
                               group_id=f"g{s}") for s in range(episodes)], return_exceptions=True)
    finally:
        await endpoint.close()
        await batcher.aclose()
    kept = [p for p in played if isinstance(p, list)]
    failed = [p for p in played if not isinstance(p, list)]
    refused = [p for p in failed if "non_append" in str(p)]
    others = [f"{type(p).__name__}: {p}"[:200] for p in failed if p not in refused]
    samples = [r for p in kept for r in p]
    return {"episodes": episodes, "episodes_kept": len(kept), "episodes_dropped": len(failed),
            "episodes_dropped_non_append": len(refused), "episodes_failed_otherwise": others,
            "samples": len(samples), "samples_per_episode": round(len(samples) / len(kept), 3) if kept else None,
            "segments_split": len(samples) - len(kept), "episodes_split": sum(len(p) > 1 for p in kept),
            "model_tokens_kept": sum(r.response_tokens for r in samples),
            "mean_reward_kept": round(sum(p[0].reward for p in kept) / len(kept), 4) if kept else None,
            "seconds": round(time.perf_counter() - start, 2)}


def _status(run: Path) -> dict[str, Any]:
    from earl_stream import protocol as P
    from earl_stream.security.secret import load_secret

    ready = run / "supervisor.json"
    if not ready.exists():
        return {}
    client = P.ControlClient(json.loads(ready.read_text())["address"], timeout_s=5, secret=load_secret(str(run / "secret")))
    try:
        return dict(json.loads(client.call(P.StatusRequest()).status_json))
    except Exception:  # the supervisor is starting or stopping: no status this time
        return {}
    finally:
        client.close()


def _train(model_dir: Path, setting: str, seconds: float, params: dict[str, int]) -> dict[str, Any]:
    """`earl-stream up` with the summarising agent for `seconds` (then Ctrl-C); the last status it answered."""
    import signal

    run = Path(tempfile.mkdtemp(prefix=f"earl-split-{setting}-"))
    envs = json.dumps([{"spec": "calculator_agent", "params": params}])
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "1000", f"model.path={model_dir}", f"run_dir={run}",
           f"envs={envs}", "trainer.groups_per_step=2", "trainer.group_size=4", "trainer.max_staleness=2",
           "rollout.workers=1", "rollout.groups_in_flight=4", "supervisor.heartbeat_s=0.5",
           f"rollout.non_append={setting}", f"rollout.openai_max_tokens={params['max_tokens']}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    last: dict[str, Any] = {}
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(2.0)
            last = _status(run) or last
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            out = ""
    keys = ("samples_produced", "samples_consumed", "episodes_produced", "segments_split", "samples_per_episode",
            "prompts_reissued", "samples_lost")
    return {"seconds": seconds, **{k: last.get(k) for k in keys}, "steps": last.get("policy_version"),
            "log_tail": out[-1500:] if not last else ""}


def run_split(model: str = "default", episodes: int = 16, summarize_after: int = 3, max_turns: int = 6,
              max_tokens: int = 48, train_seconds: float = 0.0) -> dict[str, Any]:
    """The summarising agent under split and refuse: {"episodes_kept": (split), "episodes_dropped_refuse": ...,
    "play": per setting, "train": per setting (with train_seconds > 0)}."""
    model_dir = _model_dir(model)
    params = _agent_params(summarize_after, max_turns, max_tokens)
    play = {s: asyncio.run(_play(model_dir, s, episodes, params)) for s in SETTINGS}
    out: dict[str, Any] = {
        "episodes_kept": play["split"]["episodes_kept"], "episodes_dropped_refuse": play["refuse"]["episodes_dropped"],
        "episodes": episodes, "samples_split": play["split"]["samples"],
        "segments_split": play["split"]["segments_split"], "model": model, "agent": params, "play": play}
    if train_seconds > 0:
        out["train"] = {s: _train(model_dir, s, train_seconds, params) for s in SETTINGS}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default: the embedded model (fast); smollm2: SmolLM2-135M-"
                    "Instruct from `make real-model`")
    ap.add_argument("--episodes", type=int, default=16, help="summarising-agent episodes played under each setting")
    ap.add_argument("--summarize-after", type=int, default=3, help="replies after which the agent summarises")
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per reply")
    ap.add_argument("--train-seconds", type=float, default=0.0, help="also run `up` this long under each setting")
    ap.add_argument("--json", default="bench/results/split_episodes.json")
    args = ap.parse_args(argv)
    from bench.provenance import write_result

    result = run_split(args.model, args.episodes, args.summarize_after, args.max_turns, args.max_tokens,
                       args.train_seconds)
    print(f"{'setting':8s} {'kept':>5s} {'dropped':>8s} {'samples':>8s} {'segments split':>15s} {'model tokens kept':>18s}")
    for s, r in result["play"].items():
        print(f"{s:8s} {r['episodes_kept']:5d} {r['episodes_dropped']:8d} {r['samples']:8d} {r['segments_split']:15d} "
              f"{r['model_tokens_kept']:18d}")
    for s, r in result.get("train", {}).items():
        print(f"up, {s}: {r['steps']} steps, {r['samples_consumed']} samples trained of {r['samples_produced']} "
              f"({r['episodes_produced']} episodes, {r['segments_split']} segments split), {r['prompts_reissued']} "
              "prompts re-issued")
    result.update({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()})
    print(f"wrote {write_result(args.json, result, DEPENDS_ON)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
