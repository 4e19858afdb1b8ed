"""Environments from outside the project in the rollout worker's sandboxed environment runners, real
child processes started as a worker starts them (`open_env_runners` from a run config): a hostile environment
loaded from a file tries, in its `step`, to read the run's secret, keys and checkpoints, connect to a port on the
host, fork without bound, allocate without bound, spin and sleep for ever, and exit. Each attempt fails inside (and
the environment says so in its observation) or ends its episode with `sandbox_limit: <limit>`, counted; a
well-behaved episode of the same environment then completes in a new child. A normal file-loaded environment plays
the same episodes sandboxed as in the worker's process."""

from __future__ import annotations

import asyncio
import json
import logging
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
from earl_stream.env import make_env, register_env, unregister_env
from earl_stream.env.api import is_agent_env
from earl_stream.env.tools import with_tools
from earl_stream.errors import EnvError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.sandbox import SandboxMode, bwrap_problem, launch
from earl_stream.sandbox.launch import others_can_run
from earl_stream.security.secret import SECRET_ENV
from earl_stream.workers.agent_loop import Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine
from earl_stream.workers.env_runner import SandboxedAgent, SandboxedEnv, open_env_runners, runs_sandboxed

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


def test_what_runs_sandboxed_is_told_from_the_spec_without_importing_it(tmp_path: Path) -> None:
    (tmp_path / "loud.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    assert not runs_sandboxed("tictactoe") and not runs_sandboxed("earl_stream_envs.calculator:Calculator")
    assert not runs_sandboxed("remote", {"address": "127.0.0.1:5555"}) and not runs_sandboxed("agent")
    assert not runs_sandboxed("agent", {"run": "earl_stream_envs.calculator_agent:run", "tasks": []})
    assert runs_sandboxed(f"{tmp_path}/loud.py:A") and runs_sandboxed(f"{tmp_path}/missing.py:Nothing")
    assert runs_sandboxed("agent", {"run": f"{tmp_path}/loud.py:run", "tasks": [{"q": 1}]})  # its code: a file
    assert runs_sandboxed("env_agent", {"env": "json:JSONDecoder"})  # another package's module
    assert not runs_sandboxed("tictactoe", {"model": "org/model:tag", "mode": "no_such_package:fast"})  # not code
    assert runs_sandboxed("someones_package.envs:Game")  # (not installed: its child says so)
    assert not (tmp_path / "imported").exists()
    register_env("mine_here", lambda: None)
    try:  # a name registered in this process: only this process can make it
        assert not runs_sandboxed("mine_here")
    finally:
        unregister_env("mine_here")
    assert open_env_runners(load_config(None, ["sandbox.mode=none"]), "w") is None


def test_the_sandbox_mode_is_resolved_when_the_first_environment_needs_it(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(launch, "bwrap_problem", lambda: "bubblewrap is not installed (a test)")
    caplog.set_level(logging.WARNING)
    runners = open_env_runners(load_config(None, ["sandbox.mode=bwrap"]), "lazy")
    assert runners is not None and not runners.wants(EnvSpec(spec="tictactoe"))
    assert "not available" not in caplog.text  # no environment needs a sandbox yet: nothing to warn of
    runner = runners.runner(EnvSpec(spec=f"{tmp_path}/game.py:Game"))  # the first (nothing is started here)
    assert runner.sandbox.mode is SandboxMode.PROCESS and caplog.text.count("sandbox.mode=bwrap is not available") == 1
    runners.runner(EnvSpec(spec=f"{tmp_path}/other.py:Game"))
    assert caplog.text.count("sandbox.mode=bwrap is not available") == 1


SPY = '''
import json, os
from earl_stream.env import StepResult

SEEN = {"pid": os.getpid(), "uid": os.getuid(), "secret_var": "SECRET_VAR" in os.environ}
try:
    SEEN["secret"] = open("SECRET_FILE").read()
except OSError:
    SEEN["secret"] = None
try:  # a file on the worker's filesystem
    with open("MARKER", "a") as f:
        f.write(json.dumps(SEEN) + "\\n")
except OSError:
    pass


class Spy:
    max_turn_tokens = 4

    def reset(self, seed):
        return json.dumps(SEEN)

    def step(self, action_text):
        return StepResult("", float(len(action_text) % 2), True)


class SpyAgent:
    timeout_s = 7.0

    def task(self, seed):
        return seed

    async def run(self, client, task):
        return 1.0
'''


SPY_CLASS = "class Spy:\n    def reset(self, seed):\n        return ''\n\n    def step(self, action):\n        return None\n"


def test_an_environment_file_is_loaded_only_in_its_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "run" / "secret"
    secret.parent.mkdir()
    secret.write_text("s3cr3t")
    secret.chmod(0o600)
    monkeypatch.setenv(SECRET_ENV, str(secret))  # as in a rollout worker
    marker = tmp_path / "marker"
    code = SPY.replace("SECRET_VAR", SECRET_ENV).replace("SECRET_FILE", str(secret)).replace("MARKER", str(marker))
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "spy.py").write_text(code)
    (tmp_path / "envs" / "broken.py").write_text('raise RuntimeError("this environment cannot even be imported")\n')
    plain, agent = EnvSpec(spec=f"{tmp_path}/envs/spy.py:Spy"), EnvSpec(spec=f"{tmp_path}/envs/spy.py:SpyAgent")
    broken = EnvSpec(spec=f"{tmp_path}/envs/broken.py:Spy", name="broken")

    async def go() -> None:
        runners = open_env_runners(load_config(None, [f"sandbox.mode={MODE}"]), "envload")
        assert runners is not None and runners.wants(plain) and runners.wants(agent) and runners.wants(broken)
        try:
            with pytest.raises(EnvError) as err:  # what loading it in the worker said, word for word
                await runners.check(broken)
            said = (f"environment file {tmp_path}/envs/broken.py failed to import: RuntimeError: this environment "
                    "cannot even be imported")
            assert str(err.value) == said, str(err.value)
            with pytest.raises(EnvError, match="cannot even be imported"):  # its episodes: no new child each
                await runners.envs(broken, 1)
            assert runners.runner(broken).starts == 1
            (tmp_path / "envs" / "broken.py").write_text(SPY_CLASS)  # fixed, and attached again: loaded again
            await runners.check(broken)
            assert runners.runner(broken).starts == 2 and runners.runner(broken).alive
            await runners.check(plain)
            [env] = await runners.envs(plain, 1)
            assert isinstance(env, SandboxedEnv)
            seen = json.loads(await env.reset(0))
            assert seen["pid"] != os.getpid() and seen["secret"] is None and not seen["secret_var"], seen
            await runners.check(agent)  # an agent environment: found so in its child, which is then stopped
            runner = runners.runner(agent)
            assert runner.agent is not None and not runner.alive and runner.agent.timeout_s == 7.0
            stand_ins = await runners.envs(agent, 2)
            assert all(isinstance(e, SandboxedAgent) and is_agent_env(e) for e in stand_ins)
            with pytest.raises(EnvError, match="agent_processes"):
                stand_ins[0].task(0)
        finally:
            await runners.aclose()

    asyncio.run(go())
    assert not any("earl_stream_envfile_spy" in name for name in sys.modules)  # never imported here
    lines = [json.loads(line) for line in marker.read_text().splitlines()] if marker.exists() else []
    if MODE == "bwrap":  # the worker's files do not exist inside: its top-level code could not leave a trace
        assert lines == []
    else:  # two children loaded it (the plain one, the agent one); neither this process nor the secret
        assert len(lines) == 2 and all(s["pid"] != os.getpid() and s["secret"] is None for s in lines), lines


ECHO = '''
import os
from earl_stream.env import StepResult
class Echo:
    system_prompt = "Say anything."
    def reset(self, seed):
        return "Say anything."
    def step(self, action):
        return StepResult("", 1.0, True, {"outcome": "child" if os.getpid() != PARENT else "worker"})
'''


def test_the_synchronous_loop_plays_an_environment_file_in_its_sandbox(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Every place that makes episodes' environments takes them from `episode_envs`: the synchronous loop (like
    evaluation and the training episodes) never imports another project's file in its own process."""
    from earl_stream.workers.sync_loop import run_sync_loop

    env_file = tmp_path / "echo_env.py"
    env_file.write_text(ECHO.replace("PARENT", str(os.getpid())))
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", f"envs.0.spec={env_file}:Echo",
                             f"sandbox.mode={MODE}", "trainer.groups_per_step=1", "trainer.group_size=2"])
    [step] = run_sync_loop(cfg, steps=1)
    assert step.outcomes == {"child": 2}, step.outcomes  # each episode's steps ran in another process
    assert not any("echo_env" in name for name in sys.modules)  # never imported here
