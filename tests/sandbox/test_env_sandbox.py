"""Environments from outside the project in the rollout worker's sandboxed environment runners (issue 51), real
child processes started as a worker starts them (`open_env_runners` from a run config): a hostile environment
loaded from a file tries, in its `step`, to read the run's secret, keys and checkpoints, connect to a port on the
host, fork without bound, allocate without bound, spin and sleep for ever, and exit. Each attempt fails inside (and
the environment says so in its observation) or ends its episode with `sandbox_limit: <limit>`, counted; a
well-behaved episode of the same environment then completes in a new child. A normal file-loaded environment plays
the same episodes sandboxed as in the worker's process."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from earl_stream.config import EnvSpec
from earl_stream.config.load import load_config
from earl_stream.env import make_env
from earl_stream.env.tools import with_tools
from earl_stream.errors import EnvError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.sandbox import SandboxMode, bwrap_problem
from earl_stream.sandbox.launch import others_can_run
from earl_stream.security.secret import SECRET_ENV
from earl_stream.workers.agent_loop import Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine
from earl_stream.workers.env_runner import SandboxedEnv, open_env_runners, runs_sandboxed

MODE = "bwrap" if bwrap_problem() is None else "process"

HOSTILE = '''
import os, socket, time
from earl_stream.env import StepResult


class Hostile:
    max_turn_tokens = 8

    def __init__(self, run_dir="", ports=()):
        self.run_dir, self.ports = run_dir, list(ports)

    def reset(self, seed):
        return "ready"

    def step(self, how):
        if how == "snoop":  # the variable that names the secret's file; the secret, keys and a checkpoint
            read = []
            for path in (self.run_dir + "/secret", self.run_dir + "/keys/operator",
                         self.run_dir + "/checkpoints/step_2.pt"):
                try:
                    open(path).read()
                    read.append(path)
                except OSError:
                    pass
            return StepResult(f"var={'SECRET_VAR' in os.environ} read {len(read)}: {read}", 0.0, True)
        if how == "connect":
            reached = 0
            for port in self.ports:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                    reached += 1
                except OSError:
                    pass
            return StepResult(f"reached {reached}", 0.0, True)
        if how == "fork":
            children = 0
            try:
                for _ in range(2000):
                    if os.fork() == 0:
                        time.sleep(3)
                        os._exit(0)
                    children += 1
            except OSError:
                pass
            return StepResult(f"forked {children}", 0.0, True)
        if how == "alloc":
            chunks = []
            while True:
                chunks.append(bytearray(32 << 20))
        if how == "spin":
            while True:
                pass
        if how == "sleep":
            time.sleep(3600)
        if how == "exit":
            os._exit(3)
        return StepResult("fine", 1.0, True)
'''.replace("SECRET_VAR", SECRET_ENV)

COUNTER = '''
from earl_stream.env import StepResult
from earl_stream.env.tools import Tool


class Counter:
    system_prompt = "Count with me."
    max_turn_tokens = 4
    tools = [Tool("double", "twice x", {"type": "object", "properties": {"x": {"type": "integer"}}},
                  lambda x: 2 * x)]  # (run in the child, by the ToolEnv that wraps it there)

    def __init__(self, turns=3):
        self.turns = turns

    async def reset(self, seed):
        self.n, self.seed = 0, seed
        return f"Start at {seed % 7}."

    async def step(self, action_text):
        self.n += 1
        reward = float(len(action_text) % 3 + self.seed % 2)
        return StepResult(f"Turn {self.n}: {len(action_text)}", reward, self.n >= self.turns, {"n": self.n})
'''


def _breaches(limit: str) -> float:
    return REGISTRY.get_sample_value("earl_rollout_sandbox_breaches_total", {"worker": "envbox", "limit": limit}) or 0.0


def test_a_hostile_environment_fails_alone_and_reads_nothing_of_the_run(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "keys").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir()
    for path, text in ((run_dir / "secret", "s3cr3t"), (run_dir / "keys" / "operator", "k"),
                       (run_dir / "checkpoints" / "step_2.pt", "w")):
        path.write_text(text)
    (run_dir / "secret").chmod(0o600)
    monkeypatch.setenv(SECRET_ENV, str(run_dir / "secret"))  # as in a rollout worker
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "hostile.py").write_text(HOSTILE)
    listening = socket.create_server(("127.0.0.1", 0))  # as the supervisor's control port would be
    cfg = load_config(None, [f"sandbox.mode={MODE}", "sandbox.cpu_seconds=1", f"sandbox.memory_bytes={384 << 20}",
                             "sandbox.processes=32", "sandbox.wall_seconds=8"])
    spec = EnvSpec(spec=f"{tmp_path}/envs/hostile.py:Hostile",
                   params={"run_dir": str(run_dir), "ports": [listening.getsockname()[1]]})
    took: dict[str, float] = {}

    async def go() -> None:
        runners = open_env_runners(cfg, "envbox")
        assert runners is not None and runs_sandboxed(spec.spec) and runners.sandbox.limits.wall_seconds == 8.0
        runners.attach([spec])  # started ahead of its first episode

        async def play(how: str) -> str:
            [env] = await runners.envs(spec, 1)
            assert await env.reset(0) == "ready"
            start = time.monotonic()
            try:
                result = await env.step(how)
                return result.observation if result.reward == 0 else "ok"
            except EnvError as exc:
                return f"failed: {exc}"
            finally:
                took[how] = round(time.monotonic() - start, 2)

        try:
            assert await play("ok") == "ok"
            runner = next(iter(runners.runners.values()))
            assert runner.starts == 1 and isinstance((await runners.envs(spec, 1))[0], SandboxedEnv)
            snooped = await play("snoop")
            if MODE == "bwrap":  # nothing of the run exists inside, nor the variable naming the secret's file
                assert snooped == "var=False read 0: []", snooped
                assert await play("connect") == "reached 0"  # no network: not even the host's loopback
            else:  # the host's files, as uid 65534 where root may drop to it (then not the secret, 0600)
                assert snooped.startswith("var=False"), snooped
                dropped = os.geteuid() == 0 and others_can_run(sys.executable)
                assert str(run_dir / "secret") not in snooped or not dropped, snooped
            assert await play("ok") == "ok" and runner.starts == 1  # failed attempts inside: the same child
            attempts = {"fork": "processes", "alloc": "memory", "spin": "cpu", "sleep": "wall"}
            for n, (how, limit) in enumerate(attempts.items()):
                before = _breaches(limit)
                said = await play(how)
                if how == "fork" and said.startswith("forked"):  # (no pids group: RLIMIT_NPROC refused the fork)
                    assert int(said.split()[1]) < 32, said
                else:
                    assert said.startswith(f"failed: sandbox_limit: {limit}"), (how, said)
                    assert _breaches(limit) == before + 1
                assert await play("ok") == "ok"  # a new child
                assert runner.starts == 2 + n or how == "fork", (how, runner.starts)
            died = await play("exit")
            assert "exited with code" in died and "sandbox_limit" not in died, died
            assert await play("ok") == "ok"
        finally:
            await runners.aclose()
            listening.close()
        assert runner._session is None

    asyncio.run(go())
    print(f"\nsandbox {MODE}: each attempt ended after (s): {took}")
    assert took["sleep"] < 8.0 + 5.0 and took["spin"] < 8.0 + 5.0


def test_a_file_environment_plays_the_same_sandboxed_as_in_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "counter.py").write_text(COUNTER)
    spec = EnvSpec(spec=f"{tmp_path}/counter.py:Counter", params={"turns": 3})
    cfg = load_config(None, [f"sandbox.mode={MODE}"])
    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)

    async def go() -> None:
        runners = open_env_runners(cfg, "envsame")
        assert runners is not None and runners.sandbox.mode is SandboxMode(MODE)
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        try:
            local, boxed = with_tools(make_env(spec.spec, spec.params)), (await runners.envs(spec, 1))[0]
            for env in (local, boxed):  # a scripted episode, step by step
                assert await env.reset(5) == "Start at 5."
            call = '<tool>{"name": "double", "arguments": {"x": 21}}</tool>'
            for action in (call, "a", "bb", "ccc"):
                assert await local.step(action) == await boxed.step(action)
            assert boxed.system_prompt == local.system_prompt and "double" in str(boxed.system_prompt)
            records = []
            for env in (local, (await runners.envs(spec, 1))[0]):  # and played by the agent loop
                records.append(await play_episode(env, None, ChatFormat(tokenizer), batcher, env_name="count", seed=3,
                                                  prompt_ordinal=0, group_id="g0", sampling=Sampling(temperature=0.0),
                                                  policy_version=lambda: 0, decode=tokenizer.decode, sample_seed=1))
            a, b = records
            assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
            assert (a.reward, a.turns, a.info) == (b.reward, b.turns, b.info) and a.turns == 3
            assert "Count with me." in tokenizer.decode(b.input_ids[:b.prompt_tokens].tolist())
        finally:
            await runners.aclose()
            await batcher.aclose()

    asyncio.run(go())


def test_the_projects_own_and_agent_environments_stay_in_process(tmp_path: Path) -> None:
    (tmp_path / "agentish.py").write_text("class A:\n    def task(self, seed):\n        return seed\n\n"
                                          "    async def run(self, client, task):\n        return 1.0\n")
    assert not runs_sandboxed("tictactoe") and not runs_sandboxed("earl_stream_envs.calculator:Calculator")
    assert not runs_sandboxed("remote") and not runs_sandboxed("agent")
    assert not runs_sandboxed(f"{tmp_path}/agentish.py:A")  # an agent environment: its program has its own process
    assert not runs_sandboxed(f"{tmp_path}/missing.py:Nothing")  # said by the worker, as before
    assert open_env_runners(load_config(None, ["sandbox.mode=none"]), "w") is None
