"""Test helper: a run started the way a user starts one by hand (`earl-stream supervisor` and
`earl-stream worker`), each process with its own log file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from earl_stream import protocol as P
from earl_stream.errors import EarlError
from earl_stream.security.secret import SECRET_ENV, create_secret_file, load_secret


def control_call(address: str, key: bytes, msg: P.Msg, key_file: Path | None = None) -> P.Msg:
    """One control-plane call to the supervisor at `address` signed with `key` (a role key, or the secret),
    re-read from `key_file` when given (as workers `up` started do)."""
    client = P.ControlClient(address, timeout_s=10, secret=key, key_file=str(key_file) if key_file else None)
    try:
        return client.call(msg)  # type: ignore[no-any-return]
    finally:
        client.close()


class Cluster:
    """Processes started the way a user starts them by hand: `earl-stream supervisor` / `worker`."""

    def __init__(self, tmp: Path, model_dir: Path, *overrides: str) -> None:
        self.tmp = tmp
        self.secret_file = create_secret_file(tmp / "secret")
        self.env = {**os.environ, SECRET_ENV: str(self.secret_file)}
        self.overrides = [f"model.path={model_dir}", f"run_dir={tmp / 'run'}", "trainer.groups_per_step=2",
                          "trainer.group_size=4", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2",
                          "supervisor.lease_s=3", *overrides]
        self.procs: dict[str, subprocess.Popen] = {}
        self.address = ""

    def start(self, name: str, *args: str, prefix: Sequence[str] = ()) -> subprocess.Popen:
        """`earl-stream ARGS`, run under `prefix` (e.g. `ip netns exec NS ...`) when given."""
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "earl_stream", *args], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_supervisor(self, port: int = 0, *, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
        ready = self.tmp / "ready.json"
        ready.unlink(missing_ok=True)
        self.start("supervisor", "supervisor", "--bind", f"{host}:{port}", "--ready-file", str(ready),
                   "--state-dir", str(self.tmp / "state"), *self.overrides, prefix=prefix)
        wait_for(lambda: ready.exists(), 60, "the supervisor to listen")
        self.address = json.loads(ready.read_text())["address"]

    def worker(self, name: str, role: str, *args: str, prefix: Sequence[str] = ()) -> subprocess.Popen:
        return self.start(name, "worker", "--role", role, "--supervisor", self.address, *args, prefix=prefix)

    def status(self) -> dict[str, Any]:
        secret = load_secret(str(self.secret_file))
        assert secret is not None
        return json.loads(self.call(secret, P.StatusRequest()).status_json)  # type: ignore[attr-defined]

    def call(self, key: bytes, msg: P.Msg, key_file: Path | None = None) -> P.Msg:
        return control_call(self.address, key, msg, key_file)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`earl-stream ARGS` with this cluster's secret in the environment, its output captured."""
        return subprocess.run([sys.executable, "-m", "earl_stream", *args], env=self.env, capture_output=True,
                              text=True, timeout=120)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# A one-turn environment whose reward varies within a group (the reply's length in characters, mod 5,
# over 4), so every step has non-zero advantages and moves weights and Adam moments, and rollouts and
# steps take milliseconds. Written to a file the rollout worker loads (`envs.0.spec=FILE:ReplyLength`).
REPLY_LENGTH_ENV = """
from earl_stream.env import StepResult


class ReplyLength:
    max_turn_tokens = 8
    system_prompt = "Reply with anything."

    async def reset(self, seed: int) -> str:
        return f"Say something about {seed}."

    async def step(self, action_text: str) -> StepResult:
        return StepResult("", (len(action_text) % 5) / 4, True)
"""


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = cond()
        except EarlError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
