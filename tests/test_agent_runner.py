"""Agent programs in their own process (`earl_stream.workers.agent_runner`), against the real endpoint,
engine and `openai` client: the child plays the same greedy episodes as the built-in loop; an agent
that raises, hangs or kills its own process fails only its episode, and the next one gets a new child."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from earl_stream.env import make_env
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.http import bind_socket
from earl_stream.workers.agent_episode import play_agent_episode
from earl_stream.workers.agent_loop import EpisodeFailed, Sampling, play_episode
from earl_stream.workers.agent_runner import AgentRunners
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

pytest.importorskip("openai", reason="the openai client package is not installed (pip install openai)")

AGENT_FILE = '''
import asyncio, os

async def run(client, task):
    print("the agent prints to its stdout", task)  # must not disturb the runner's own channel
    if task["how"] == "exit":
        os._exit(3)
    if task["how"] == "hang":
        await asyncio.sleep(3600)
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
    if task["how"] == "raise":
        raise RuntimeError("agent bug")
    return 0.5 + 0 * len(out.choices[0].message.content)
'''


def test_an_agent_process_plays_the_built_in_loops_episodes_and_fails_alone(tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)
    chat = ChatFormat(tokenizer)
    (tmp_path / "agent.py").write_text(AGENT_FILE)
    hows = ["ok", "raise", "hang", "exit"]
    agent_spec = ("agent", {"run": f"{tmp_path / 'agent.py'}:run", "tasks": [{"how": h} for h in hows],
                            "timeout_s": 3.0})

    async def go() -> None:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        endpoint = OpenAIEndpoint(batcher, tokenizer, chat, model="policy", secret=b"s3", max_context=4096,
                                  default_max_tokens=32, temperature=0.0)
        await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        runners = AgentRunners(1, "w0")
        try:
            seeds = range(3)
            builtin = await asyncio.gather(*[
                play_episode(make_env("tictactoe"), None, chat, batcher, env_name="ttt", seed=s, prompt_ordinal=s,
                             group_id=f"g{s}", sampling=Sampling(temperature=0.0), policy_version=lambda: 0,
                             decode=tokenizer.decode) for s in seeds])
            spec = ("env_agent", {"env": "tictactoe", "temperature": 0.0})
            served = [one for [one] in await asyncio.gather(*[
                play_agent_episode(make_env(*spec), endpoint, api_key="s3", env_name="ttt", seed=s, prompt_ordinal=s,
                                   group_id=f"g{s}", runner=runners, spec=spec) for s in seeds])]
            for a, b in zip(builtin, served):
                assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
                np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-4)
                assert (a.turns, a.reward) == (b.turns, b.reward) and b.info["prefix_mismatches"] == 0

            env = make_env(*agent_spec)

            async def play(seed: int) -> object:
                [record] = await play_agent_episode(env, endpoint, api_key="s3", env_name="fn", seed=seed,
                                                    prompt_ordinal=seed, group_id=f"f{seed}", runner=runners,
                                                    spec=agent_spec)
                return record

            ok, raised, hung = await asyncio.gather(*[play(i) for i in range(3)], return_exceptions=True)
            assert getattr(ok, "reward", None) == 0.5, ok
            assert isinstance(raised, EpisodeFailed) and "agent bug" in str(raised)
            assert isinstance(hung, EpisodeFailed) and "longer than 3s" in str(hung)
            with pytest.raises(EpisodeFailed, match="exited with code 3"):
                await play(3)
            again = await play(0)  # a new child
            assert again.reward == 0.5 and runners.runners[0].starts == 2  # type: ignore[attr-defined]
            bad_key = await asyncio.gather(play_agent_episode(
                env, endpoint, api_key="wrong", env_name="fn", seed=0, prompt_ordinal=0, group_id="k",
                runner=runners, spec=agent_spec), return_exceptions=True)
            assert isinstance(bad_key[0], EpisodeFailed) and "AuthenticationError" in str(bad_key[0]), bad_key
            assert len(endpoint.episodes) == 0  # every episode was collected, failed ones too
        finally:
            await runners.aclose()
            await endpoint.close()
            await batcher.aclose()
        assert all(r._proc is None or r._proc.returncode is not None for r in runners.runners)

    asyncio.run(go())


def test_a_child_slow_to_start_does_not_time_its_first_episode_out(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy host can take longer to start the child than an episode may last: the episode's clock starts when
    the child says it is ready. The child's start is slowed on purpose (a sitecustomize that sleeps 7 s, more
    than the 1 s timeout plus the worker's grace) and its episode still completes; a child that dies before it
    is ready fails the episode with why."""
    from earl_stream.workers import agent_runner as ar

    (tmp_path / "agent.py").write_text("async def run(client, task):\n    return 0.25\n")
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(7)\n")
    env = dict(ar.agent_environment(), PYTHONPATH=str(slow))
    monkeypatch.setattr(ar, "agent_environment", lambda: env)
    spec = {"run": f"{tmp_path / 'agent.py'}:run", "tasks": [{}], "timeout_s": 1.0}

    async def go() -> None:
        runner = ar.AgentRunner("slow-start")
        try:
            reward = await runner.run("agent", spec, 0, url="http://127.0.0.1:9/v1", api_key="k", episode_key="e",
                                      timeout_s=1.0)
            assert reward == 0.25 and runner.starts == 1
        finally:
            await runner.aclose()
        (slow / "sitecustomize.py").write_text("import os\nos._exit(7)\n")
        runner = ar.AgentRunner("dies-at-start")
        try:
            # (the code itself: 7, or 255 where another waitpid in the test process reaped the child first, as
            # asyncio reports an exit it did not see)
            with pytest.raises(EpisodeFailed, match=r"could not start the agent process: dies-at-start \(pid \d+\): "
                                                    r"exited with code (7|255) before it was ready"):
                await runner.run("agent", spec, 0, url="http://127.0.0.1:9/v1", api_key="k", episode_key="e",
                                 timeout_s=1.0)
        finally:
            await runner.aclose()

    asyncio.run(go())
