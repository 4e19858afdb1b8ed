"""A live `earl-stream up` (supervisor, rollout worker, trainer as real processes): the rollout worker's
OpenAI endpoint is listed by `earl-stream status --json`, answers the real `openai` client (chat with
tools, a streamed completion, an unknown model, a wrong key), and an agent environment (the calculator
written as an OpenAI tools agent) trains through it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cluster import wait_for

from earl_stream.security.secret import SECRET_ENV, create_secret_file

openai = pytest.importorskip("openai", reason="the openai client package is not installed (pip install openai)")

pytestmark = pytest.mark.slow


async def _talk(url: str, key: str) -> None:
    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
    try:
        assert [m.id for m in (await client.models.list()).data] == ["policy"]
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
        chat = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+2?"}],
                                                    tools=tools, max_tokens=8)
        assert chat.choices[0].finish_reason in ("stop", "length", "tool_calls") and chat.usage.completion_tokens <= 8
        stream = await client.completions.create(model="policy", prompt="abc", max_tokens=4, stream=True)
        assert [c async for c in stream]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    finally:
        await client.close()
    wrong = openai.AsyncOpenAI(base_url=url, api_key="not-the-secret", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.models.list()
    await wrong.close()


@pytest.mark.live
def test_agent_env_trains_through_the_endpoint_of_a_live_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    run, secret = tmp_path / "run", create_secret_file(tmp_path / "secret")
    env = {**os.environ, SECRET_ENV: str(secret)}
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "0", f"model.path={tiny_model_dir}", f"run_dir={run}",
           "rollout.workers=1", "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2",
           "supervisor.heartbeat_s=0.2", "envs.0.spec=calculator_agent", "envs.0.name=calc_agent",
           "envs.0.params={max_turns: 2, max_tokens: 12}"]
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def status() -> dict[str, Any]:
        try:
            address = json.loads((run / "supervisor.json").read_text())["address"]
        except (OSError, ValueError, KeyError):
            return {}
        out = subprocess.run([sys.executable, "-m", "earl_stream", "status", "--json", "--supervisor", address],
                             env=env, capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else {}

    try:
        listed = wait_for(lambda: (s := status()) and any(w["role"] == "rollout" and w["openai_url"] for w in s["workers"])
                          and s, 180, "the rollout worker's openai_url in `status --json`")
        [url] = [w["openai_url"] for w in listed["workers"] if w["role"] == "rollout"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        asyncio.run(_talk(url, secret.read_text().strip()))

        s = wait_for(lambda: (st := status()) and st["policy_version"] >= 3 and st, 240, "three training steps")
        assert s["envs"]["calc_agent"]["episodes"] >= 3 * 2 * 4
        assert s["samples_consumed"] >= 3 * 2 * 4
    finally:
        up.terminate()
        up.wait(60)
    assert "Traceback" not in log.read_text()
