"""A rollout worker's helper children (`agent_runner`, `env_runner`): how one is started, sandboxed or not, how
frames cross its socket, and how its end is read back (its exit code, the sandbox limit it went past).

What the children run and the messages they speak are their modules'; this one owns only the plumbing they
share: `start_child` (a socket pair, the child's environment without the cluster secret, its first frame
awaited before any episode's clock starts), `end_child` (its exit awaited, what it left in its sandbox killed,
the sandbox freed), `frame`/`read_frame` (a 4-byte big-endian length, then a msgpack-encoded message),
`serve_frames` (the child's side: each message from the worker run as a task of its own) and `breach_text` (the
`sandbox_limit: <limit>` reason episodes fail with).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import socket
import struct
import sys
from collections.abc import Callable, Coroutine, Hashable, Mapping
from typing import Any

import msgspec

from earl_stream.sandbox import Breach, Launch, SandboxSpec, prepare, sandbox_environment
from earl_stream.security.secret import SECRET_ENV

__all__ = ["GRACE_S", "MAX_FRAME", "START_CPU_S", "START_TIMEOUT_S", "Child", "breach_text", "child_environment",
           "end_child", "frame", "read_frame", "serve_frames", "start_child"]

MAX_FRAME = 16 * 1024 * 1024
# how long a child may take to end once its socket closed before it is killed; also what the worker waits past an
# episode's own timeout (which the child enforces) before it gives the episode up itself
GRACE_S = 5.0
# how long a new child may take to say it is ready (Python and the environments' registry imported: ~4 s on a
# quiet core, several times that on a busy host); its start-up never counts against an episode's timeout
START_TIMEOUT_S = 120.0
START_CPU_S = 30.0  # CPU seconds a sandboxed child may spend starting (imports), besides its episodes' budgets

_encoder = msgspec.msgpack.Encoder()


def frame(msg: msgspec.Struct) -> bytes:
    """`msg` as one frame: its msgpack length (4 bytes, big-endian), then its msgpack."""
    body = _encoder.encode(msg)
    return struct.pack(">I", len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The body of the next frame (IncompleteReadError at the end of the socket; ConnectionError past MAX_FRAME)."""
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    if size > MAX_FRAME:
        raise ConnectionError(f"child process frame of {size} bytes")
    return await reader.readexactly(size)


async def serve_frames(reader: asyncio.StreamReader, decode: Callable[[bytes], Any],
                       dispatch: Callable[[Any], tuple[Hashable, Coroutine[Any, Any, None]] | None],
                       running: dict[Hashable, asyncio.Task[None]]) -> None:
    """A child's loop: each frame from the worker decoded and given to `dispatch`, whose work (a key, a coroutine)
    runs as a task, under its key in `running` until it ends (None: nothing to run). Returns when the worker's end
    of the socket closes, the tasks still running cancelled."""
    try:
        while True:
            try:
                msg = decode(await read_frame(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the worker went away (or stopped us)
            work = dispatch(msg)
            if work is not None:
                key, coro = work
                task = running[key] = asyncio.create_task(coro)
                task.add_done_callback(functools.partial(_drop, running, key))
    finally:
        tasks = list(running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _drop(running: dict[Hashable, asyncio.Task[None]], key: Hashable, _task: asyncio.Task[None]) -> None:
    running.pop(key, None)


def child_environment() -> dict[str, str]:
    """A child's environment: the worker's, less the variables that name the cluster secret's file and the TLS
    key's. (Outside a bwrap sandbox a child runs where the worker's files are: code that goes looking can read
    what its user can.)"""
    from earl_stream.security.tls import TLS_KEY_ENV

    return {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, TLS_KEY_ENV)}


@dataclasses.dataclass
class Child:
    """A started child: its process, the worker's end of its socket, its sandbox (None: not sandboxed) and the
    first frame it sent (its "ready")."""

    proc: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    launch: Launch | None
    ready: bytes


async def start_child(module: str, args: list[str], *, name: str, env: Mapping[str, str],
                      sandbox: SandboxSpec | None = None, python_path: tuple[str, ...] = (), hello: bytes = b"",
                      check: Callable[[bytes], None] = lambda _body: None) -> Child:
    """Start `python -m module --fd N *args` (in `sandbox` where given, its environment `env` less secrets, with
    `python_path` first on its import path), send it `hello` (frames) and wait for its first frame, which `check`
    refuses by raising ConnectionError. OSError ("NAME (pid N): why") when it cannot start or is not ready
    within START_TIMEOUT_S."""
    parent, sock = socket.socketpair()
    argv = [sys.executable, "-m", module, "--fd", str(sock.fileno()), *args]
    launch = None
    if sandbox is not None:  # its start-up's CPU on top of the first episode's budget (`allow_cpu`)
        limits = dataclasses.replace(sandbox.limits, cpu_seconds=sandbox.limits.cpu_seconds + START_CPU_S)
        boxed = sandbox_environment(env)
        if python_path:
            boxed["PYTHONPATH"] = os.pathsep.join([*python_path, *filter(None, [boxed.get("PYTHONPATH")])])
        launch = prepare(argv, dataclasses.replace(sandbox, limits=limits), env=boxed)
    try:
        if launch is None:
            proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(sock.fileno(),), env=dict(env))
        else:
            proc = await asyncio.create_subprocess_exec(*launch.command, pass_fds=(sock.fileno(),), env=launch.env,
                                                        cwd=launch.cwd, preexec_fn=launch.preexec)
    except BaseException:
        parent.close()
        if launch is not None:
            launch.cleanup()
        raise
    finally:
        sock.close()
    reader, writer = await asyncio.open_connection(sock=parent)
    try:  # its imports done before any episode's clock starts (a busy host must not time episodes out)
        if hello:
            writer.write(hello)
            await writer.drain()
        ready = await asyncio.wait_for(read_frame(reader), START_TIMEOUT_S)
        check(ready)
    except BaseException as exc:  # (cancelled too: a child is never left behind)
        writer.close()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        if launch is not None:
            launch.kill(proc.pid)
            launch.cleanup()
        if not isinstance(exc, (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError,
                                msgspec.DecodeError)):
            raise
        why = f"not ready within {START_TIMEOUT_S:.0f}s" if isinstance(exc, asyncio.TimeoutError) else (
            f"exited with code {proc.returncode} before it was ready"
            if isinstance(exc, asyncio.IncompleteReadError) else str(exc))
        raise OSError(f"{name} (pid {proc.pid}): {why}") from None
    return Child(proc, reader, writer, launch, ready)


async def end_child(proc: asyncio.subprocess.Process, launch: Launch | None, eof: bool) -> tuple[int, Breach | None]:
    """Once a child's socket ended (`eof`: it closed; else it sent garbage or failed): its exit code (killed when
    it lingers past GRACE_S, at once when not `eof`: it is not trusted again) and the sandbox limit it went past.
    Kills what it left running in its sandbox and frees the sandbox."""
    try:  # at the end of its socket the child is exiting: its own exit code, not a kill's
        code = await asyncio.wait_for(proc.wait(), GRACE_S if eof else 0.0)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        code = await proc.wait()
    breach = launch.breach(code) if launch is not None else None
    if launch is not None:
        launch.kill(proc.pid)
        launch.cleanup()
    return code, breach


def breach_text(breach: Breach, spec: SandboxSpec | None, wall_s: float | None = None) -> str:
    """`sandbox_limit: <limit> (...)`: the reason an episode failed for, its limit's setting named (`wall_s`: the
    wall-clock limit of one call, where the caller holds one)."""
    limits = spec.limits if spec is not None else None
    said = {Breach.CPU: f"more than sandbox.cpu_seconds={limits.cpu_seconds:g} CPU seconds" if limits else "",
            Breach.MEMORY: f"more than sandbox.memory_bytes={limits.memory_bytes} bytes" if limits else "",
            Breach.PROCESSES: f"more than sandbox.processes={limits.processes} processes" if limits else "",
            Breach.WALL: f"a call ran past its {wall_s:g}s wall-clock limit" if wall_s else
            "past its wall-clock limit"}[breach]
    return f"sandbox_limit: {breach.value} ({said})"
