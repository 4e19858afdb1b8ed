"""The environment protocol helpers and the registry: names, entry points, module and file specs."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
import textwrap
from pathlib import Path

import pytest

import earl_stream.env.registry as env_registry
from earl_stream.env import (
    Environment,
    EnvOptions,
    Observation,
    StepResult,
    env_options,
    env_reset,
    env_step,
    known_envs,
    make_env,
    register_env,
    resolve_env,
    unregister_env,
)
from earl_stream.errors import EnvError


class SyncEcho:
    """A synchronous environment: echoes the action, ends on 'stop'."""

    system_prompt = None

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def reset(self, seed: int) -> str:
        return f"{self.prefix}start {seed}"

    def step(self, action_text: str) -> StepResult:
        return StepResult(self.prefix + action_text, 1.0, action_text == "stop")


class AsyncBroken:
    async def reset(self, seed: int) -> int:
        return seed

    async def step(self, action_text: str) -> tuple[str, float, bool]:
        return (action_text, 0.0, True)


class Crashing:
    def reset(self, seed: int) -> str:
        raise ValueError("boom")

    def step(self, action_text: str) -> StepResult:
        raise AssertionError("unreachable")


def test_step_result_is_frozen_with_default_info() -> None:
    r = StepResult("obs", 0.5, False)
    assert r.info == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.reward = 1.0  # type: ignore[misc]


def test_sync_and_async_environments_are_driven_alike() -> None:
    async def go() -> None:
        env = SyncEcho("> ")
        assert await env_reset(env, 7) == "> start 7"
        assert await env_step(env, "stop") == StepResult("> stop", 1.0, True)
        tic = make_env("tictactoe")
        assert await env_reset(tic, 0) == "1 2 3\n4 5 6\n7 8 9"
        assert isinstance(await env_step(tic, "5"), StepResult)

    asyncio.run(go())


def test_an_environment_that_never_awaits_is_driven_without_an_event_loop() -> None:
    from earl_stream.env.api import run_now

    assert run_now(env_reset(SyncEcho("> "), 7)) == "> start 7"
    assert run_now(env_reset(make_env("tictactoe"), 0)) == "1 2 3\n4 5 6\n7 8 9"

    async def waits() -> str:
        await asyncio.sleep(0)
        return "never"

    with pytest.raises(EnvError, match="suspended"):
        run_now(waits())


def test_bad_results_and_crashes_become_env_errors() -> None:
    async def go() -> None:
        with pytest.raises(EnvError, match="reset.*str"):
            await env_reset(AsyncBroken(), 1)
        with pytest.raises(EnvError, match="StepResult"):
            await env_step(AsyncBroken(), "x")
        with pytest.raises(EnvError, match="ValueError: boom"):
            await env_reset(Crashing(), 0)
        with pytest.raises(EnvError, match="no callable step"):
            await env_step(object(), "x")

    asyncio.run(go())


def test_env_options_defaults_and_validation() -> None:
    assert env_options(SyncEcho()) == EnvOptions(None, 32, None)

    class Bad(SyncEcho):
        max_turn_tokens = 0

    with pytest.raises(EnvError, match="max_turn_tokens"):
        env_options(Bad())


def test_builtin_name_and_module_spec_resolve() -> None:
    cls = resolve_env("tictactoe")
    assert cls.__name__ == "TicTacToe"
    from earl_stream_envs.tictactoe import TicTacToe

    assert resolve_env("earl_stream_envs.tictactoe:TicTacToe") is TicTacToe
    assert "tictactoe" in known_envs()
    env = make_env("earl_stream_envs.tictactoe:TicTacToe")
    assert isinstance(env, Environment)


def test_builtin_fallback_when_envs_is_not_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    # As in an uninstalled source tree run from elsewhere: no entry points, no `envs` on sys.path.
    monkeypatch.setattr(env_registry, "_entry_points", lambda: {})
    monkeypatch.setitem(sys.modules, "envs", None)  # makes `import earl_stream_envs` raise ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "earl_stream_envs.tictactoe", raising=False)
    cls = resolve_env("tictactoe")
    assert cls.__name__ == "TicTacToe"
    assert asyncio.run(cls().reset(1)) == "1 2 3\n4 5 6\n7 8 9"


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(EnvError, match=r"unknown environment 'nope'.*tictactoe"):
        resolve_env("nope")
    with pytest.raises(EnvError, match="cannot import module"):
        resolve_env("no_such_module_xyz:Env")
    with pytest.raises(EnvError, match="has no attribute 'Nope'"):
        resolve_env("earl_stream_envs.tictactoe:Nope")
    with pytest.raises(EnvError, match="does not exist"):
        resolve_env("/no/such/file.py:Env")


def test_file_spec(tmp_path: Path) -> None:
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from earl_stream.env import StepResult

        @dataclass
        class Counter:
            start: int = 0

            async def reset(self, seed: int) -> str:
                self.n = self.start + seed
                return str(self.n)

            async def step(self, action_text: str) -> StepResult:
                self.n += 1
                return StepResult(str(self.n), 0.0, self.n >= 3)

        NOT_AN_ENV = 3
    """))
    cls = resolve_env(f"{path}:Counter")
    assert resolve_env(f"{path}:Counter") is cls  # imported once per path
    env = make_env(f"{path}:Counter", {"start": 1})
    assert asyncio.run(env_reset(env, 1)) == "2"
    with pytest.raises(EnvError, match="not a class or factory"):
        resolve_env(f"{path}:NOT_AN_ENV")
    with pytest.raises(EnvError, match="could not be created"):
        make_env(f"{path}:Counter", {"no_such_param": 1})
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('import-time failure')\n")
    with pytest.raises(EnvError, match="import-time failure"):
        resolve_env(f"{broken}:X")


def test_register_refuses_duplicates_and_names_are_listed() -> None:
    register_env("echo-test", SyncEcho)
    try:
        with pytest.raises(EnvError, match="already registered"):
            register_env("echo-test", SyncEcho)
        assert "echo-test" in known_envs()
        env = make_env("echo-test", {"prefix": "# "})
        assert asyncio.run(env_reset(env, 2)) == "# start 2"
    finally:
        unregister_env("echo-test")
    assert "echo-test" not in known_envs()
    with pytest.raises(EnvError):
        register_env("bad:name", SyncEcho)
    with pytest.raises(EnvError, match="callable"):
        register_env("not-callable", 3)  # type: ignore[arg-type]


def test_entry_point_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real (if minimal) installed distribution that declares an entry point in our group.
    pkg = tmp_path / "ep_env_pkg.py"
    pkg.write_text(textwrap.dedent("""
        from earl_stream.env import StepResult

        class Coin:
            async def reset(self, seed: int) -> str:
                return "flip"

            async def step(self, action_text: str) -> StepResult:
                return StepResult("", 1.0 if action_text == "heads" else 0.0, True)
    """))
    dist = tmp_path / "ep_env_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-env-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[earl_stream.envs]\ncoin = ep_env_pkg:Coin\nbad = ep_env_pkg:Missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"coin", "bad"} <= set(known_envs())
    env = make_env("coin")
    assert asyncio.run(env_step(env, "heads")).reward == 1.0
    with pytest.raises(EnvError, match="entry point"):
        resolve_env("bad")


# Known names that need params: served environments (tests/envs/test_env_server.py, and OpenEnv servers),
# agents from a function and a dataset (tests/test_openai_agent_env.py) and verifiers environments
# (tests/envs/test_ecosystems.py) have no default to build here.
NEEDS_PARAMS: dict[str, dict | None] = {"remote": None, "agent": None, "verifiers": None, "openenv": None,
                                        "gymnasium": {"id": "FrozenLake-v1"}, "env_agent": {"env": "tictactoe"}}


@pytest.mark.parametrize("name", [n for n in known_envs()])
def test_every_known_env_honours_the_protocol(name: str) -> None:
    from earl_stream.env.api import is_agent_env

    if name in NEEDS_PARAMS and NEEDS_PARAMS[name] is None:
        pytest.skip(f"{name} needs a server or a user's function to build")
    if name == "gymnasium":
        pytest.importorskip("gymnasium")

    async def go() -> None:
        env = make_env(name, NEEDS_PARAMS.get(name))
        env_options(env)
        if is_agent_env(env):  # played through the OpenAI endpoint: task() and run() instead of reset/step
            env.task(0)  # type: ignore[attr-defined]
            return
        assert isinstance(await env_reset(env, 0), (str, Observation))
        result = await env_step(env, "1")
        assert isinstance(result, StepResult) and isinstance(result.reward, float)

    asyncio.run(go())


def test_builtin_envs_resolve_from_an_uninstalled_source_tree() -> None:
    """A checkout run with only its root on sys.path (no install, no site-packages: `python -S`): the envs/
    folder serves as `earl_stream_envs`, the name the install gives it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import earl_stream.env as E; "
            "f = E.resolve_env('tictactoe'); print(f.__module__, f.__name__)")
    done = subprocess.run([sys.executable, "-S", "-c", code, str(root)], capture_output=True, text=True, timeout=60,
                          cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["earl_stream_envs.tictactoe", "TicTacToe"]


def test_the_old_envs_package_name_is_refused_with_the_new_one(tmp_path, monkeypatch) -> None:
    """Specs written for 0.1 (`envs.tictactoe:TicTacToe`) name the package the environments install as now (the old
    name is built in pieces so that the rename script leaves it alone)."""
    import pytest

    from earl_stream.env import resolve_env
    from earl_stream.errors import EnvError

    monkeypatch.chdir(tmp_path)  # not the repository root, whose envs/ folder would import as `envs`
    root = str(Path(__file__).resolve().parents[1])  # PYTHONPATH=<checkout> would make its envs/ folder `envs`
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".", root)])
    monkeypatch.delitem(__import__("sys").modules, "envs", raising=False)
    with pytest.raises(EnvError, match="earl_stream_envs.tictactoe:TicTacToe"):
        resolve_env("envs" + ".tictactoe:TicTacToe")


@pytest.mark.parametrize("old, new", [("agent_env:EnvAsAgent", "earl_stream.env.agent:EnvAsAgent"),
                                      ("env_server:RemoteEnv", "earl_stream.env.server:RemoteEnv"),
                                      ("tools:ToolEnv", "earl_stream.env.tools:ToolEnv")])
def test_the_old_module_paths_of_the_env_api_are_refused_with_the_new_ones(old: str, new: str) -> None:
    """The environment API is the package earl_stream.env since 0.2.0: a spec with a 0.1 module path names the new one
    (the old path is built in pieces so that the import rewrite leaves it alone)."""
    with pytest.raises(EnvError, match=re.escape(f"use {new!r}")):
        resolve_env("earl_stream." + old)
    assert resolve_env(new).__module__ == new.partition(":")[0]
