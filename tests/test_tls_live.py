"""A live `earl-stream up` with `security.tls=true`: the rollout worker's OpenAI endpoint and every metrics
endpoint serve HTTPS with the run CA `up` wrote; the run's agent environment trains through HTTPS with its
per-episode agent keys; the `openai` client trusting RUN_DIR/tls/ca.pem works, plain HTTP does not; metrics
answer the read-only key `up` wrote and refuse a request without it; `status` runs with that key."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cluster import wait_for

from earl_stream.security.secret import SECRET_ENV, create_secret_file
from earl_stream.security.tls import client_context

openai = pytest.importorskip("openai", reason="the openai client package is not installed (pip install openai)")

pytestmark = pytest.mark.slow


async def _talk(url: str, key: str, ca: str) -> None:
    trusting = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0,
                                  http_client=openai.DefaultAsyncHttpxClient(verify=client_context(ca)))
    assert [m.id for m in (await trusting.models.list()).data] == ["policy"]
    await trusting.close()
    plain = openai.AsyncOpenAI(base_url=url.replace("https://", "http://"), api_key=key, max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        await plain.models.list()
    await plain.close()


def _scrape(address: str, ca: str, token: str | None) -> int:
    req = urllib.request.Request(f"https://{address}/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=client_context(ca)) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.live
def test_up_with_tls_serves_https_and_trains_agents_through_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    run, secret = tmp_path / "run", create_secret_file(tmp_path / "secret")
    env = {**os.environ, SECRET_ENV: str(secret)}
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "0", f"model.path={tiny_model_dir}", f"run_dir={run}",
           "rollout.workers=1", "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2",
           "supervisor.heartbeat_s=0.2", "envs.0.spec=calculator_agent", "envs.0.name=calc_agent",
           "envs.0.params={max_turns: 2, max_tokens: 12}", "security.tls=true"]
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    readonly = run / "keys" / "readonly"

    def status() -> dict[str, Any]:
        try:
            address = json.loads((run / "supervisor.json").read_text())["address"]
        except (OSError, ValueError, KeyError):
            return {}
        out = subprocess.run([sys.executable, "-m", "earl_stream", "status", "--json", "--supervisor", address,
                              "--secret-file", str(readonly)], env=env, capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else {}

    try:
        listed = wait_for(lambda: readonly.exists() and (s := status()) and any(
            w["role"] == "rollout" and w["openai_url"] for w in s["workers"]) and s, 180, "the rollout worker's openai_url")
        [url] = [w["openai_url"] for w in listed["workers"] if w["role"] == "rollout"]
        assert url.startswith("https://127.0.0.1:")
        ca = (run / "tls" / "ca.pem").read_text()
        asyncio.run(_talk(url, secret.read_text().strip(), ca))
        token = readonly.read_text().strip()
        for address in [listed["metrics_address"]] + [w["metrics_address"] for w in listed["workers"]]:
            assert _scrape(address, ca, token) == 200 and _scrape(address, ca, None) == 401
        s = wait_for(lambda: (st := status()) and st["policy_version"] >= 2 and st, 240, "two training steps")
        assert s["envs"]["calc_agent"]["episodes"] >= 2 * 2 * 4  # agents played through HTTPS with agent keys
    finally:
        up.terminate()
        up.wait(60)
    text = log.read_text()
    assert "Traceback" not in text and f"clients trust the CA in {run.resolve() / 'tls' / 'ca.pem'}" in text
    assert "credentials_file" in text
