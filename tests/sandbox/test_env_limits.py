"""An environment's own sandbox `limits` and `network` (`EnvSpec`): checked at load, laid over `sandbox.*`, and
given to the agent processes of that environment only (the processes of another keep the run's)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from earl_stream.config.load import load_config
from earl_stream.errors import ConfigError
from earl_stream.sandbox import Limits, SandboxMode, SandboxSpec
from earl_stream.workers.agent_runner import AgentRunners
from earl_stream.workers.agent_sandbox import EnvSource, env_sandbox


def test_limits_and_network_are_checked_at_load(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("envs:\n  - spec: env_agent\n    limits: {cpu: 6, processes: -1}\n    network: [nohost]\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    said = str(err.value)
    assert "unknown limit 'cpu'" in said and "limits.processes=-1 must be a number > 0" in said
    assert "'nohost' is not host:port" in said
    good = tmp_path / "good.yaml"
    good.write_text("envs:\n  - spec: env_agent\n    limits: {cpu_seconds: 600}\n    network: ['example.com:443']\n")
    env = load_config(good).envs[0]
    assert (env.limits, env.network) == ({"cpu_seconds": 600}, ["example.com:443"])


def test_an_environments_limits_override_the_runs_and_its_processes_are_its_own() -> None:
    base = SandboxSpec(mode=SandboxMode.BWRAP, limits=Limits(cpu_seconds=60, memory_bytes=1 << 30, processes=32))
    mine = env_sandbox(base, {"cpu_seconds": 600, "processes": 8}, ["example.com:443"])
    assert mine.limits == Limits(cpu_seconds=600.0, wall_seconds=base.limits.wall_seconds, memory_bytes=1 << 30,
                                 processes=8)
    assert mine.network == ("example.com:443",) and env_sandbox(base, {}, []) is base
    runners = AgentRunners(1, "w0", base, "/tmp/earl-agents-test/openai.sock")
    plain = runners._pool(EnvSource.of("env_agent", {}), {}, ())
    limited = runners._pool(EnvSource.of("env_agent", {}), {"cpu_seconds": 600, "processes": 8}, ["example.com:443"])
    again = runners._pool(EnvSource.of("env_agent", {}), {}, ())
    assert plain is again and limited is not plain and len(runners.runners) == 2
    assert plain[0].sandbox is not None and plain[0].sandbox.limits.cpu_seconds == 60
    assert limited[0].sandbox is not None and limited[0].sandbox.limits.processes == 8
    assert limited[0].sandbox.network == ("example.com:443",) and not plain[0].sandbox.network
    asyncio.run(runners.aclose())  # nothing was started


def test_code_and_files_named_in_params_are_shown_read_only_and_made_absolute(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "mine.py").write_text("async def run(client, task):\n    return 1.0\n")
    (tmp_path / "tasks.jsonl").write_text('{"q": 1}\n')
    monkeypatch.chdir(tmp_path)
    source = EnvSource.of("agent", {"run": "agents/mine.py:run", "tasks": "tasks.jsonl", "data": {"dir": str(tmp_path)}})
    assert source.params["run"] == f"{(tmp_path / 'agents' / 'mine.py').resolve()}:run"
    assert source.params["tasks"] == str((tmp_path / "tasks.jsonl").resolve())
    # the code's folder and the file named; never a folder a parameter names
    assert source.read_only == (str((tmp_path / "agents").resolve()), str((tmp_path / "tasks.jsonl").resolve()))
    assert source.params["data"] == {"dir": str(tmp_path)}
