"""Agent environments through the OpenAI endpoint, in one process with the real engine and client:
the same game played by the built-in loop and by an OpenAI-API agent gives the same sample (greedy),
and agents that fail, hang or never call the model fail only their own episode."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from earl_stream.env import make_env
from earl_stream.env.agent import EnvAsAgent
from earl_stream.errors import EnvError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.http import bind_socket
from earl_stream.workers.agent_episode import play_agent_episode
from earl_stream.workers.agent_loop import EpisodeFailed, Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

pytest.importorskip("openai", reason="the openai client package is not installed (pip install openai)")


class Broken:
    def __init__(self, how: str) -> None:
        self.how, self.timeout_s = how, 1.0

    def task(self, seed: int) -> int:
        return seed

    async def run(self, client: Any, task: int) -> float:
        if self.how == "hang":
            await asyncio.sleep(3600)
        if self.how == "raise":
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2)
            raise RuntimeError("agent bug")
        return 1.0  # "silent": never asks the model


def test_builtin_loop_and_openai_agent_give_the_same_samples(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)
    chat = ChatFormat(tokenizer)

    async def go() -> None:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        endpoint = OpenAIEndpoint(batcher, tokenizer, chat, model="policy", secret=None, max_context=4096,
                                  default_max_tokens=32, temperature=0.0)
        await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        try:
            seeds = range(4)
            builtin = await asyncio.gather(*[
                play_episode(make_env("tictactoe"), None, chat, batcher, env_name="ttt", seed=s, prompt_ordinal=s,
                             group_id=f"g{s}", sampling=Sampling(temperature=0.0), policy_version=lambda: 0,
                             decode=tokenizer.decode) for s in seeds])
            agent = EnvAsAgent("tictactoe", temperature=0.0)
            served = [one for [one] in await asyncio.gather(*[
                play_agent_episode(agent, endpoint, api_key="none", env_name="ttt", seed=s, prompt_ordinal=s,
                                   group_id=f"g{s}") for s in seeds])]
            for a, b in zip(builtin, served):
                assert a.input_ids.tolist() == b.input_ids.tolist()
                assert a.loss_mask.tolist() == b.loss_mask.tolist() and a.policy_version.tolist() == b.policy_version.tolist()
                np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-4)
                assert (a.turns, a.prompt_tokens, a.reward) == (b.turns, b.prompt_tokens, b.reward)
                assert b.info["prefix_mismatches"] == 0 and b.segments == 1
            assert len(endpoint.episodes) == 0  # every episode was collected
            for how, match in (("hang", "longer than"), ("raise", "agent bug"), ("silent", "without a successful request")):
                with pytest.raises(EpisodeFailed, match=match):
                    await play_agent_episode(Broken(how), endpoint, api_key="none", env_name="x", seed=0,
                                             prompt_ordinal=0, group_id="gx")
            assert len(endpoint.episodes) == 0  # a failed episode leaves nothing behind
        finally:
            await endpoint.close()
            await batcher.aclose()

    asyncio.run(go())


AGENT_FILE = '''
async def run(client, task):
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["q"]}],
                                               max_tokens=3)
    return task["reward"] + 0 * len(out.choices[0].message.content)
'''


def test_a_plain_function_and_a_dataset_make_an_agent_environment(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT_FILE)
    (tmp_path / "tasks.jsonl").write_text('{"q": "a", "reward": 0.25}\n{"q": "b", "reward": 0.75}\n')
    env = make_env("agent", {"run": f"{tmp_path / 'agent.py'}:run", "tasks": str(tmp_path / "tasks.jsonl")})
    assert env.task(3) == {"q": "b", "reward": 0.75}  # type: ignore[attr-defined]
    for bad in ({"run": f"{tmp_path / 'agent.py'}:nope", "tasks": []}, {"run": "no_colon", "tasks": [1]},
                {"run": f"{tmp_path / 'agent.py'}:run", "tasks": str(tmp_path / "missing.jsonl")}):
        with pytest.raises(EnvError):
            make_env("agent", bad)
    model, tokenizer = load_model(tiny_model_dir)

    async def go() -> None:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=None,
                                  max_context=4096, default_max_tokens=8)
        await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        try:
            [record] = await play_agent_episode(env, endpoint, api_key="none", env_name="fn", seed=1, prompt_ordinal=1,
                                                group_id="g1")
        finally:
            await endpoint.close()
            await batcher.aclose()
        assert record.reward == 0.75 and record.turns == 1 and 1 <= record.response_tokens <= 3
        end = record.prompt_tokens + record.response_tokens  # then at most the end-of-turn token closing a cut reply
        assert record.loss_mask[:record.prompt_tokens].sum() == 0 and record.loss_mask[record.prompt_tokens:end].all()

    asyncio.run(go())
