"""Agents get an agent key per episode, never the cluster secret: an agent program that records the api_key
and the environment it was given finds no secret there; with that key the OpenAI endpoint serves only its own
episode's requests while it runs, and the supervisor refuses status, scale and env attach."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from cluster import Cluster

from earl_stream import protocol as P
from earl_stream.env import make_env
from earl_stream.errors import ProtocolError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.auth import Denied, EndpointAuth, Grant
from earl_stream.openai_api.http import bind_socket
from earl_stream.security.keys import KeyRole, agent_key, role_of, role_token
from earl_stream.security.secret import SECRET_ENV, load_secret
from earl_stream.workers.agent_episode import play_agent_episode
from earl_stream.workers.agent_runner import AgentRunners
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

SECRET = b"0123456789abcdef" * 4

# Records what it was given, then tries its key on another episode's requests.
RECORDING_AGENT = '''
import json, os, openai

async def run(client, task):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    other = client.with_options(default_headers={"X-Episode-Id": "someone-elses-episode"})
    try:
        await other.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        other_status = 200
    except openai.APIStatusError as exc:
        other_status = exc.status_code
    with open(task["out"], "w") as f:
        json.dump({"api_key": client.api_key, "env": dict(os.environ), "other_status": other_status}, f)
    return 1.0
'''


def test_endpoint_auth_grants_an_agent_key_only_its_episode_until_it_ends_or_expires() -> None:
    auth = EndpointAuth(SECRET)
    key = auth.agent_key("g-1", 60)
    assert auth.grant(f"Bearer {key}") == Grant("g-1") and auth.grant(f"Bearer {SECRET.decode()}") == Grant()
    assert EndpointAuth.episode_of(Grant("g-1"), "") == "g-1"  # a request naming no episode is filed under its own
    with pytest.raises(Denied, match="for episode 'g-1', not 'g-2'") as wrong:
        EndpointAuth.episode_of(Grant("g-1"), "g-2")
    assert wrong.value.status == 403
    cases = {f"Bearer {agent_key(SECRET, 'g-1', 1, now=0)}": "expired",
             f"Bearer {agent_key(b'another secret of 32 bytes long!', 'g-1', 60)}": "not this run's",
             f"Bearer {role_token(SECRET, KeyRole.READONLY).decode()}": "readonly key is not accepted",
             "Bearer nope": "wrong API key", "": "missing API key"}
    for header, why in cases.items():
        with pytest.raises(Denied, match=why) as refused:
            auth.grant(header)
        assert refused.value.status == 401
    derived = agent_key(SECRET, "mine", 60)  # `keys derive agent --episode mine`: a user's own agent program
    assert auth.grant(f"Bearer {derived}") == Grant("mine")
    auth.ended("g-1")  # the worker's episode ended: its key no longer holds (a replayed key), long before expiry
    with pytest.raises(Denied, match="no longer valid: that episode has ended"):
        auth.grant(f"Bearer {key}")
    assert auth.grant(f"Bearer {derived}") == Grant("mine")
    assert EndpointAuth(None).grant("") == Grant()  # an open run


@pytest.mark.slow
def test_an_agent_program_never_sees_the_secret_and_its_key_opens_only_its_episode(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    openai = pytest.importorskip("openai", reason="the openai client package is not installed")
    cluster = Cluster(tmp_path, tiny_model_dir)
    cluster.start_supervisor()
    secret = load_secret(str(cluster.secret_file))
    assert secret is not None
    monkeypatch.setenv(SECRET_ENV, str(cluster.secret_file))  # as in a rollout worker
    (tmp_path / "agent.py").write_text(RECORDING_AGENT)
    out = tmp_path / "seen.json"
    spec = ("agent", {"run": f"{tmp_path / 'agent.py'}:run", "tasks": [{"out": str(out)}], "timeout_s": 30.0})
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)

    async def go() -> None:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=secret,
                                  max_context=4096, default_max_tokens=8, temperature=0.0)
        url = await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        runners = AgentRunners(1, "w0")
        try:
            [record] = await play_agent_episode(make_env(*spec), endpoint, env_name="a", seed=0, prompt_ordinal=0,
                                                group_id="g0", runner=runners, spec=spec)
            assert record.reward == 1.0 and record.turns == 1  # the refused request left no trace in the sample
            key = json.loads(out.read_text())["api_key"]
            late = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="that episode has ended"):
                await late.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
            await late.close()
        finally:
            await runners.aclose()
            await endpoint.close()
            await batcher.aclose()

    try:
        asyncio.run(go())
        seen = json.loads(out.read_text())
        key = seen["api_key"]
        assert role_of(key.encode()) is KeyRole.AGENT and secret.decode() not in key
        assert seen["other_status"] == 403
        assert SECRET_ENV not in seen["env"] and not any(secret.decode() in v for v in seen["env"].values())
        assert os.environ[SECRET_ENV] == str(cluster.secret_file)  # (the worker's own environment keeps it)
        # the control plane takes no agent key: no status, no scale, no env attach
        for msg in (P.StatusRequest(), P.Scale(replicas=5), P.EnvAttach(spec=f"{tmp_path / 'agent.py'}:run")):
            client = P.ControlClient(cluster.address, timeout_s=10, secret=key.encode())
            with pytest.raises(ProtocolError, match="authentication failed"):
                client.call(msg)
            client.close()
        status = cluster.status()
        assert status["pools"]["rollout"]["desired"] is None and len(status["envs"]) == 1
    finally:
        cluster.stop()
