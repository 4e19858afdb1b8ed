"""Environment servers: an environment served by its own process (`earl-stream env serve`) and played
by a rollout worker through `RemoteEnv`; a server that is killed mid-run fails only its own episodes,
whose prompts are played again once it is back."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cluster import Cluster, wait_for

from earl_stream.env.server import EnvServer, RemoteEnv
from earl_stream.errors import EnvError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.security.secret import SECRET_ENV
from earl_stream.workers.agent_loop import Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

SECRET = b"fedcba9876543210fedcba9876543210"


def test_a_served_environment_plays_like_a_local_one(tiny_model_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "secret").write_bytes(SECRET)
    monkeypatch.setenv(SECRET_ENV, str(tmp_path / "secret"))
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)
    engine = TorchEngine(model.eval(), seed=0)

    async def go() -> None:
        server = EnvServer("calculator", {"max_turns": 2}, secret=SECRET)
        stop = asyncio.Event()
        serving = asyncio.create_task(server.serve(stop))
        batcher = AsyncBatcher(engine)
        try:
            env = RemoteEnv(server.address, timeout_s=10)
            record = await play_episode(env, None, ChatFormat(tokenizer), batcher, env_name="calc", seed=3,
                                        prompt_ordinal=0, group_id="g0", sampling=Sampling(), policy_version=lambda: 0,
                                        decode=tokenizer.decode)
            assert record.turns >= 1 and record.info["outcome"] in ("correct", "wrong", "too_many_turns",
                                                                    "too_many_tool_calls")
            assert env.system_prompt is not None and "calculator" in env.system_prompt  # options came with reset
            assert "calculator" in tokenizer.decode(record.input_ids[:record.prompt_tokens].tolist())
            with pytest.raises(EnvError, match="not open"):
                await env.step("answer: 1")  # the episode is over: the server dropped it
            wrong = RemoteEnv(server.address, timeout_s=10)
            wrong.secret = b"x" * 32
            with pytest.raises(EnvError, match="authentication failed"):
                await wrong.reset(1)
        finally:
            stop.set()
            await serving
            await batcher.aclose()
        gone = RemoteEnv(server.address, timeout_s=0.5)
        with pytest.raises(EnvError, match="did not answer within"):
            await gone.reset(1)

    asyncio.run(go())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _episodes(status: dict, name: str) -> int:
    return int(status["envs"].get(name, {}).get("episodes", 0))


@pytest.mark.faults
def test_a_killed_env_server_fails_only_its_episodes(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", "rollout.groups_in_flight=3")
    port = _free_port()
    serve = [sys.executable, "-m", "earl_stream", "env", "serve", "connect_four", "--bind", f"127.0.0.1:{port}"]
    try:
        cluster.start_supervisor()
        cluster.worker("rollout", "rollout")
        cluster.worker("trainer", "trainer")
        server = cluster.start("env-server", *serve[3:])
        wait_for(lambda: any(w["role"] == "rollout" and w["openai_url"] for w in cluster.status()["workers"]), 180,
                 "the rollout worker's engine to start")  # (its endpoint is registered once the engine is up)
        out = subprocess.run([sys.executable, "-m", "earl_stream", "env", "attach", "c4", "--address", f"127.0.0.1:{port}",
                              "--param", "timeout_s=2", "--wait", "120", "--supervisor", cluster.address],
                             env=cluster.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        wait_for(lambda: _episodes(cluster.status(), "c4") >= 8, 120, "episodes of the served environment")

        server.send_signal(signal.SIGKILL)
        server.wait()
        dead = cluster.status()
        log = tmp_path / "rollout.log"
        wait_for(lambda: re.search(r"episode of g\d+\.\d+ failed: .*did not answer", log.read_text()), 60,
                 "an episode of the dead server to fail")
        later = wait_for(lambda: (s := cluster.status())["policy_version"] >= dead["policy_version"] + 2 and s, 180,
                         "training to go on without the server")
        assert _episodes(later, "tictactoe") > _episodes(dead, "tictactoe")
        assert later["prompts_reissued"] > dead["prompts_reissued"]
        assert all(w["alive"] for w in later["workers"]), "a worker died with the environment server"

        cluster.start("env-server-2", *serve[3:])  # back on the same address: its prompts are played again
        wait_for(lambda: _episodes(cluster.status(), "c4") >= _episodes(later, "c4") + 8, 120,
                 "episodes of the restarted server")
        assert json.loads(json.dumps(cluster.status()["envs"]["c4"]))["spec"] == "remote"
    finally:
        cluster.stop()
