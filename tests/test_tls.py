"""TLS for the HTTP endpoints (earl_stream/security/tls.py): a run CA derived from the cluster secret, HTTPS metrics and
OpenAI endpoints that a client trusting the CA reaches while plain HTTP and another CA fail, and metrics that
refuse a request without the read-only key."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from cluster import Cluster, wait_for

from earl_stream import metrics as M
from earl_stream.env import make_env
from earl_stream.errors import ConfigError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.http import bind_socket
from earl_stream.security.keys import KeyRole, role_token
from earl_stream.security.secret import load_secret
from earl_stream.security.tls import TLS_ENV, client_context, run_ca, run_ca_pem, server_context, tls_env
from earl_stream.workers.agent_episode import play_agent_episode
from earl_stream.workers.agent_runner import AgentRunners
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

SECRET = b"0123456789abcdef" * 4
OTHER = b"fedcba9876543210" * 4


def _get(url: str, *, ca: str | None = None, token: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token.decode()}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=client_context(ca) if ca else None) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_run_ca_is_the_same_wherever_the_secret_is() -> None:
    key1, cert1 = run_ca(SECRET)
    key2, cert2 = run_ca(SECRET)
    assert key1.private_numbers() == key2.private_numbers() and cert1.subject == cert2.subject
    assert run_ca(OTHER)[0].private_numbers() != key1.private_numbers()
    assert "BEGIN CERTIFICATE" in run_ca_pem(SECRET)
    with pytest.raises(ConfigError, match="not a usable CA"):
        client_context("not a certificate")


def test_tls_files_are_given_together_or_not_at_all(tmp_path: Path) -> None:
    from earl_stream.config import load_config

    cert = tmp_path / "c.pem"
    cert.write_text("x")
    sec = load_config(None, [f"security.tls_cert_file={cert}", "security.tls_ca_file=/nonexistent/ca.pem"]).security
    with pytest.raises(ConfigError) as bad:
        tls_env(sec)
    assert "tls_ca_file='/nonexistent/ca.pem' does not exist" in str(bad.value) and "security.tls_key_file" in str(bad.value)
    on = tls_env(load_config(None, ["security.encrypt=true"]).security)
    assert on[TLS_ENV] == "1" and on["EARL_STREAM_METRICS_AUTH"] == "1"  # encryption implies TLS, TLS the token
    assert tls_env(load_config(None, []).security)[TLS_ENV] == "0"  # off by default


def test_metrics_serve_https_with_the_run_ca_and_refuse_requests_without_the_token() -> None:
    token = role_token(SECRET, KeyRole.READONLY)
    address = M.start_metrics_server("127.0.0.1", tls=server_context(["127.0.0.1"], secret=SECRET), token=token)
    url, ca = f"https://{address}/metrics", run_ca_pem(SECRET)
    status, text = _get(url, ca=ca, token=token)
    assert status == 200 and "earl_security_refused_total" in text
    assert _get(url, ca=ca)[0] == 401  # no token
    assert _get(url, ca=ca, token=role_token(SECRET, KeyRole.OPERATOR))[0] == 401  # another key
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _get(url, ca=run_ca_pem(OTHER), token=token)  # a client trusting another CA
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _get(f"http://{address}/metrics", token=token)  # plain HTTP gets no answer

    def refused() -> dict[str, float]:
        status, text = _get(url, ca=ca, token=token)
        assert status == 200
        found = re.findall(r'earl_security_refused_total\{plane="metrics",reason="(\w+)"\} (\S+)', text)
        return {reason: float(n) for reason, n in found}

    # a failed handshake is counted in its request's thread once the server gives up on it, which may be
    # after the client already has its error: the count is waited for, not read once
    wait_for(lambda: refused().get("tls", 0) >= 2, 10, "both failed handshakes counted")
    assert refused()["token"] >= 2
    # a token without TLS: plain HTTP, still refused without it
    plain = M.start_metrics_server("127.0.0.1", token=token)
    assert _get(f"http://{plain}/metrics")[0] == 401 and _get(f"http://{plain}/metrics", token=token)[0] == 200


def test_the_openai_endpoint_and_its_agents_speak_https_with_the_run_ca(tiny_model_dir: Path) -> None:
    openai = pytest.importorskip("openai", reason="the openai client package is not installed")
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)
    ca = run_ca_pem(SECRET)

    async def go() -> None:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=SECRET,
                                  max_context=4096, default_max_tokens=4, temperature=0.0)
        url = await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1",
                                   server_context(["127.0.0.1"], secret=SECRET), ca)
        assert url.startswith("https://") and endpoint.local_url.startswith("https://")
        runners = AgentRunners(1, "w0")
        messages = [{"role": "user", "content": "hi"}]
        try:
            trusting = openai.AsyncOpenAI(base_url=url, api_key=SECRET.decode(), max_retries=0,
                                          http_client=openai.DefaultAsyncHttpxClient(verify=client_context(ca)))
            reply = await trusting.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            assert reply.choices[0].message is not None
            await trusting.close()
            untrusting = openai.AsyncOpenAI(base_url=url, api_key=SECRET.decode(), max_retries=0,
                                            http_client=openai.DefaultAsyncHttpxClient(
                                                verify=client_context(run_ca_pem(OTHER))))
            with pytest.raises(openai.APIConnectionError):
                await untrusting.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            await untrusting.close()
            plain = openai.AsyncOpenAI(base_url=url.replace("https://", "http://"), api_key=SECRET.decode(),
                                       max_retries=0)
            with pytest.raises(openai.APIConnectionError):
                await plain.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            await plain.close()
            # the worker's agent process is handed the CA with its agent key
            spec = ("env_agent", {"env": "tictactoe", "temperature": 0.0})
            [record] = await play_agent_episode(make_env(*spec), endpoint, env_name="ttt", seed=0, prompt_ordinal=0,
                                                group_id="g0", runner=runners, spec=spec)
            assert record.turns >= 1
        finally:
            await runners.aclose()
            await endpoint.close()
            await batcher.aclose()

    asyncio.run(go())


@pytest.mark.slow
def test_a_supervisor_with_tls_serves_its_metrics_to_the_read_only_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir)
    cluster.env[TLS_ENV] = "1"  # what `up` and its launchers set under security.tls=true
    try:
        cluster.start_supervisor()
        secret = load_secret(str(cluster.secret_file))
        assert secret is not None
        metrics = json.loads((tmp_path / "ready.json").read_text())["metrics_address"]
        url, ca = f"https://{metrics}/metrics", run_ca_pem(secret)
        status, text = _get(url, ca=ca, token=role_token(secret, KeyRole.READONLY))
        assert status == 200 and "earl_samples" in text
        assert _get(url, ca=ca)[0] == 401
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _get(f"http://{metrics}/metrics")
        assert cluster.status()["address"] == cluster.address  # the control plane is unchanged
    finally:
        cluster.stop()


def test_ssl_module_rejects_an_untrusted_handshake_at_once() -> None:
    """(A plain `ssl` client with the system's CAs does not trust the run CA either.)"""
    address = M.start_metrics_server("127.0.0.1", tls=server_context(["127.0.0.1"], secret=SECRET))
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://{address}/metrics", timeout=10, context=ssl.create_default_context())


def test_tls_files_that_do_not_fit_together_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from earl_stream.config import load_config
    from earl_stream.security.tls import issue

    cert, key = issue(SECRET, ["127.0.0.1"])
    _, other_key = issue(SECRET, ["127.0.0.1"])
    files = {"cert": cert, "key": key, "other_key": other_key, "ca": run_ca_pem(SECRET).encode(),
             "other_ca": run_ca_pem(OTHER).encode()}
    for name, data in files.items():
        (tmp_path / f"{name}.pem").write_bytes(data)

    def env(key_name: str, ca_name: str) -> dict[str, str]:
        return tls_env(load_config(None, ["security.tls=true", f"security.tls_cert_file={tmp_path / 'cert.pem'}",
                                          f"security.tls_key_file={tmp_path / key_name}.pem",
                                          f"security.tls_ca_file={tmp_path / ca_name}.pem"]).security)

    given = env("key", "ca")
    assert given["EARL_STREAM_TLS_CERT"] == str(tmp_path / "cert.pem")
    for name, value in given.items():  # what a process of the run finds in its environment: the files win
        monkeypatch.setenv(name, value)
    address = M.start_metrics_server("127.0.0.1", token=b"t0ken")
    assert _get(f"https://{address}/metrics", ca=files["ca"].decode(), token=b"t0ken")[0] == 200
    with pytest.raises(ConfigError, match="did not sign"):
        env("key", "other_ca")
    with pytest.raises(ConfigError, match="is not the key of"):
        env("other_key", "ca")
