"""Hostile agent programs in the rollout worker's sandboxed agent processes, against the real endpoint,
engine and `openai` client, started as a worker starts them (`open_agent_runners` from a run config): each tries to
read the run's secret, keys and checkpoints, connect to the worker's TCP endpoint and to a supervisor port, fork
without bound, spin and allocate for ever. Under bwrap each attempt fails or ends its episode with
`sandbox_limit: <limit>`; a well-behaved agent keeps playing through the endpoint's Unix socket, in a new process
after a breach."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import torch

from earl_stream.config.load import load_config
from earl_stream.env import make_env
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.http import bind_socket
from earl_stream.sandbox import bwrap_problem
from earl_stream.sandbox.cgroups import control_groups
from earl_stream.workers.agent_episode import play_agent_episode
from earl_stream.workers.agent_loop import EpisodeFailed
from earl_stream.workers.agent_runner import open_agent_runners
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

pytest.importorskip("openai", reason="the openai client package is not installed (pip install openai)")

HOSTILE = '''
import json, os, socket, time


async def ask(client):
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
    return 0 * len(out.choices[0].message.content)


async def run(client, task):
    how = task["how"]
    if how == "snoop":  # what of the run and the host can it read? (the reward says how much)
        read = 0
        run_dir, home = task["run_dir"], task["home"]  # folders: a parameter naming one does not show it
        for path in (run_dir + "/secret", run_dir + "/keys/operator", run_dir + "/checkpoints/step_2.pt",
                     home + "/.bashrc"):
            try:
                open(path).read()
                read += 1
            except OSError:
                pass
        return read + await ask(client)
    if how == "connect":  # which of the host's servers can it reach?
        reached = 0
        for port in task["ports"]:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                reached += 1
            except OSError:
                pass
        return reached + await ask(client)
    if how == "fork":  # how many processes can it have?
        children = 0
        try:
            for _ in range(2000):
                if os.fork() == 0:
                    time.sleep(3)
                    os._exit(0)
                children += 1
        except OSError:
            pass
        return children + await ask(client)
    if how == "spin":
        while True:
            pass
    if how == "alloc":
        chunks = []
        while True:
            chunks.append(bytearray(32 << 20))
    return 0.5 + await ask(client)
'''


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bwrap here: {bwrap_problem()}")
def test_hostile_agents_fail_alone_and_read_nothing_of_the_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)
    run_dir = tmp_path / "run"
    (run_dir / "keys").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir()
    for path, text in ((run_dir / "secret", "s3cr3t"), (run_dir / "keys" / "operator", "k"),
                       (run_dir / "checkpoints" / "step_2.pt", "w")):
        path.write_text(text)
    (run_dir / "secret").chmod(0o600)
    agent_file = tmp_path / "agents" / "hostile.py"
    agent_file.parent.mkdir()
    agent_file.write_text(HOSTILE)
    supervisor = socket.create_server(("127.0.0.1", 0))  # as the supervisor's control port would be
    cfg = load_config(None, ["sandbox.mode=bwrap", "sandbox.cpu_seconds=3", f"sandbox.memory_bytes={768 << 20}",
                             "sandbox.processes=64", "rollout.agent_processes=1"])
    hows = ["ok", "snoop", "connect", "fork", "spin", "alloc"]
    tasks: list[dict[str, object]] = [{"how": h, "run_dir": str(run_dir), "home": str(Path.home()), "ports": [0]}
                                      for h in hows]
    spec = ("agent", {"run": f"{agent_file}:run", "tasks": tasks, "timeout_s": 60.0})

    async def go() -> None:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=b"s3",
                                  max_context=4096, default_max_tokens=8, temperature=0.0)
        await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        tcp_port = int(endpoint.url.rsplit(":", 1)[1].split("/")[0])
        for task in tasks:
            task["ports"] = [tcp_port, supervisor.getsockname()[1]]
        env = make_env(spec[0], {**spec[1], "tasks": tasks})
        runners = await open_agent_runners(cfg, "w0", endpoint)
        assert runners.sandbox is not None and Path(runners.endpoint_socket).is_socket()

        async def play(seed: int) -> float | EpisodeFailed:
            try:
                [record] = await play_agent_episode(env, endpoint, env_name="hostile", seed=seed, prompt_ordinal=seed,
                                                    group_id=f"g{seed}", runner=runners,
                                                    spec=(spec[0], {**spec[1], "tasks": tasks}))
                return record.reward
            except EpisodeFailed as exc:
                return exc

        try:
            ok = await play(0)
            assert ok == 0.5, ok  # through the Unix socket: the sandbox has no network
            assert await play(1) == 0.0  # the run's secret, keys, checkpoint, and the home: none exists inside
            assert await play(2) == 0.0  # neither the worker's TCP endpoint nor the supervisor's port
            forked = await play(3)
            assert isinstance(forked, float) and forked < 64, forked  # held at sandbox.processes
            spun = await play(4)
            assert isinstance(spun, EpisodeFailed) and "sandbox_limit: cpu" in str(spun), spun
            assert await play(0) == 0.5  # a new process
            allocated = await play(5)
            if "memory" in control_groups():
                assert isinstance(allocated, EpisodeFailed) and "sandbox_limit: memory" in str(allocated), allocated
            else:  # RLIMIT_AS: the agent's own allocation fails
                assert isinstance(allocated, EpisodeFailed) and "MemoryError" in str(allocated), allocated
            assert await play(0) == 0.5
            assert runners.runners[0].starts == 3
        finally:
            await runners.aclose()
            await endpoint.close()
            await batcher.aclose()
            supervisor.close()
        assert not Path(runners.endpoint_socket).exists()

    asyncio.run(go())
