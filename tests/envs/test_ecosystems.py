"""The verifiers and OpenEnv adapters against the real packages, offline, each playing an episode with
the built-in engine: a verifiers environment written here and loaded with `load_environment`, run as an
agent environment through the OpenAI endpoint; an OpenEnv environment server started here (uvicorn, no
containers) and played over its WebSocket protocol. `make test-ecosystems` runs them in their own venv."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from earl_stream.env import make_env
from earl_stream.errors import EnvError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.http import bind_socket
from earl_stream.workers.agent_episode import play_agent_episode
from earl_stream.workers.agent_loop import Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

pytestmark = pytest.mark.ecosystems

VF_ENV = '''
import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 4):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)]

    def correct(completion, answer, **kwargs) -> float:
        return 1.0 if answer in str(completion[-1]["content"]) else 0.0

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt="Reply with the number only.",
                            rubric=vf.Rubric(funcs=[correct]))
'''

OPENENV_SERVER = '''
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""


class GuessDigit(Environment):
    """Guess a digit 0-9 in three tries; reward 1 on a hit."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.target = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = (seed or 0) % 10
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="Guess my digit (0-9).", reward=0.0, done=False)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        digits = [c for c in action.message if c.isdigit()]
        hit = bool(digits) and int(digits[0]) == self.target
        done = hit or self._state.step_count >= 3
        return GuessObservation(text="right" if hit else "wrong, again", reward=1.0 if hit else 0.0, done=done)

    @property
    def state(self):
        return self._state


app = create_fastapi_app(GuessDigit, GuessAction, GuessObservation)
'''


def _engine(model_dir: Path) -> tuple[TorchEngine, object]:
    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir)
    return TorchEngine(model.eval(), seed=0), tokenizer


def test_verifiers_environment_plays_through_the_endpoint(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("verifiers", reason="verifiers is not installed (make test-ecosystems)")
    pytest.importorskip("openai", reason="the openai client package is not installed")
    (tmp_path / "earl_vf_arith.py").write_text(VF_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("verifiers", {"env_id": "earl_vf_arith", "env_args": {"n": 3}, "sampling_args": {"max_tokens": 6}})
    assert env.task(4)["answer"] == "2"  # type: ignore[attr-defined]
    with pytest.raises(EnvError, match="load_environment"):
        make_env("verifiers", {"env_id": "earl_no_such_vf_env"})
    engine, tokenizer = _engine(tiny_model_dir)

    async def go() -> None:
        batcher = AsyncBatcher(engine)
        endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=None,  # type: ignore[arg-type]
                                  max_context=4096, default_max_tokens=8)
        await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        try:
            records = [r for s in range(3) for r in await play_agent_episode(
                env, endpoint, api_key="none", env_name="vf", seed=s, prompt_ordinal=s, group_id=f"g{s}")]
        finally:
            await endpoint.close()
            await batcher.aclose()
        for s, record in enumerate(records):
            assert record.turns == 1 and record.reward in (0.0, 1.0) and 1 <= record.response_tokens <= 6
            prompt = tokenizer.decode(record.input_ids[:record.prompt_tokens].tolist())  # type: ignore[attr-defined]
            assert f"What is {s} + {s}?" in prompt and "Reply with the number only." in prompt

    asyncio.run(go())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_openenv_server_plays_an_episode(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("openenv.core", reason="openenv-core is not installed (make test-ecosystems)")
    pytest.importorskip("uvicorn", reason="uvicorn is not installed (openenv-core[core])")
    (tmp_path / "guess_server.py").write_text(OPENENV_SERVER)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "guess_server:app", "--host", "127.0.0.1",
                               "--port", str(port)], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError("the OpenEnv server did not start") from None
                time.sleep(0.2)
        env = make_env("openenv", {"base_url": f"http://127.0.0.1:{port}", "observation_field": "text",
                                   "system_prompt": "Reply with one digit.", "max_turn_tokens": 4})

        async def scripted() -> None:
            assert await env.reset(7) == "Guess my digit (0-9)."
            first = await env.step("I say 3")
            assert (first.observation, first.reward, first.done) == ("wrong, again", 0.0, False)
            hit = await env.step("7")
            assert hit.done and hit.reward == 1.0 and hit.info == {"outcome": "done", "return": 1.0}

        asyncio.run(scripted())
        engine, tokenizer = _engine(tiny_model_dir)

        async def played() -> None:
            batcher = AsyncBatcher(engine)
            try:
                record = await play_episode(env, None, ChatFormat(tokenizer), batcher, env_name="openenv", seed=3,  # type: ignore[arg-type]
                                            prompt_ordinal=0, group_id="g0", sampling=Sampling(),
                                            policy_version=lambda: 0, decode=tokenizer.decode)  # type: ignore[attr-defined]
            finally:
                await batcher.aclose()
            assert 1 <= record.turns <= 3 and record.info["outcome"] == "done"
            assert "Guess my digit" in tokenizer.decode(record.input_ids[:record.prompt_tokens].tolist())  # type: ignore[attr-defined]

        asyncio.run(played())
        server.kill()
        server.wait()
        gone = make_env("openenv", {"base_url": f"http://127.0.0.1:{port}", "timeout_s": 2})
        with pytest.raises(EnvError, match="OpenEnv server"):
            asyncio.run(gone.reset(1))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
