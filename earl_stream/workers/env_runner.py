"""Environments from outside this project in sandboxed children of the rollout worker: their `reset`/`step` (and
the tools they run) never share the worker's process, memory, files or cluster secret.

The worker's side: `EnvRunners` (one per worker, `open_env_runners`) keeps an `EnvRunner` for each environment
that `runs_sandboxed` picks out (a file, a module or an entry point of another package), and hands the agent loop
`SandboxedEnv`s: plain `Environment`s whose `reset`/`step` go to that runner's child as `EnvCall`s carrying the
messages of `earl_stream.env.host` (no pickles), so the agent loop needs no change. Its child is started ahead
of need (when the worker starts, or when an environment is attached) and serves all the episodes of its
environment, concurrently, until it dies or goes past a limit; the next episode then gets a new one.

The child (`python -m earl_stream.workers.env_runner --fd N`), started by `child_process.start_child` in a sandbox
of `sandbox.*` (bwrap: only the interpreter, the packages and the environment's own files, read-only; no network
unless the environment declares one; no secret in its environment), reads `HostLoad` (the spec and params as
`EnvSource` resolves them inside), makes one instance to check it can (`EnvHost`) and answers `HostReady`; then
it answers each `EnvCall` with an `EnvAnswer`.

Limits (the environment's `limits` over `sandbox.*`): a reset or step that runs past `wall_seconds` (`sandbox.wall_seconds`, 20 s) gets
the child killed; a child killed for CPU (`cpu_seconds`, counted from the start of the latest call: before each
call the limit moves to what the child used plus `cpu_seconds`), memory (its memory group's OOM kill, or an
allocation an address-space limit refused) or processes (a fork its pids group refused) fails every episode it
was serving with `sandbox_limit: <limit>` (`breach_text`), counted in `earl_rollout_sandbox_breaches_total`; one
that simply dies fails them with its exit code. The worker goes on.

With concurrent episodes the CPU limit is the child's, not an episode's: any call moves it on for all, so a call
that spins is stopped by its CPU limit only once no other call started for `cpu_seconds` of the child's CPU (its
wall limit always holds), and the episodes that shared the child with it fail with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import inspect
import itertools
import json
import logging
import os
import socket
import sys
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from earl_stream import metrics as M
from earl_stream.env.api import DEFAULT_MAX_TURN_TOKENS, StepResult, is_agent_env
from earl_stream.env.host import (
    EnvClose,
    EnvFailed,
    EnvHost,
    EnvOpen,
    EnvOpened,
    EnvReply,
    EnvRequest,
    EnvStep,
    EnvStepped,
    failure,
    out_of_memory,
)
from earl_stream.env.registry import ENTRY_POINT_GROUP, resolve_env
from earl_stream.errors import EnvError
from earl_stream.sandbox import Breach, SandboxSpec
from earl_stream.workers.agent_sandbox import EnvSource, agent_sandbox, env_sandbox
from earl_stream.workers.child_process import Child, breach_text, child_environment, end_child, frame, read_frame, start_child

if TYPE_CHECKING:
    from earl_stream.config import EnvSpec, RunConfig

__all__ = ["EnvRunner", "EnvRunners", "SandboxedEnv", "open_env_runners", "runs_sandboxed"]

log = logging.getLogger(__name__)

# the wall-clock limit of one reset or step: below the agent loop's 30 s step timeout, so that the runner, which can
# stop the child, acts first
IDLE_S = 600.0  # an instance whose episode saw no call for this long is dropped in the child (its driver is gone)
_OURS = ("earl_stream", "earl_stream_envs")


class HostLoad(msgspec.Struct, tag="load", frozen=True):
    """The worker's first frame: the environment the child hosts."""
    spec: str
    params: dict[str, Any]
    idle_s: float = IDLE_S


class HostReady(msgspec.Struct, tag="ready", frozen=True):
    """The child's first frame, once its imports are done and an instance was made (else `error` says why)."""
    pid: int
    seed_per_episode: bool = False
    error: str = ""


class EnvCall(msgspec.Struct, tag="call", frozen=True):
    call: int
    msg: EnvRequest


class EnvAnswer(msgspec.Struct, tag="answer", frozen=True):
    call: int
    msg: EnvReply
    out_of_memory: bool = False  # the environment's allocation was refused (an address-space limit)


_to_child = msgspec.msgpack.Decoder(HostLoad | EnvCall)
_to_worker = msgspec.msgpack.Decoder(HostReady | EnvAnswer)


def runs_sandboxed(spec: str) -> bool:
    """Whether environment `spec` is code from outside this project: a file (`path.py:Class`), a module of another
    package (`module:Class`) or another package's entry point. Not this project's own environments, names
    registered in this process (`register_env`: a child could not make them), agent environments (their programs
    have sandboxed processes of their own, `agent_runner`), nor what does not resolve (the caller says why)."""
    try:
        factory = resolve_env(spec)
    except EnvError:
        return False
    if inspect.isclass(factory) and is_agent_env(factory):
        return False
    if str(getattr(factory, "__module__", "") or "").split(".")[0] in _OURS:
        return False
    spec = spec.strip()
    return ":" in spec or spec in {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


@dataclasses.dataclass
class _Session:
    """One child of a runner and the calls it is serving."""
    child: Child
    pending: dict[int, asyncio.Future[EnvAnswer]] = dataclasses.field(default_factory=dict)
    alive: bool = True
    reader: asyncio.Task[None] | None = None


class EnvRunner:
    """The child hosting the instances of one environment (`source`), in `sandbox`; `sandbox.limits.wall_seconds`
    bounds each call."""

    def __init__(self, source: EnvSource, sandbox: SandboxSpec, *, name: str = "env-runner", worker: str = "") -> None:
        self.source, self.sandbox, self.name, self.worker = source, sandbox, name, worker or name
        self.seed_per_episode = False  # the environment's, known once a child is ready
        self.starts = 0
        self._session: _Session | None = None
        self._ids = itertools.count()
        self._start_lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        """Whether a child is running (and taking calls)."""
        return self._session is not None and self._session.alive

    @property
    def load(self) -> int:
        """Calls the child is serving now."""
        return len(self._session.pending) if self._session is not None else 0

    async def start(self) -> None:
        """Start a child unless one is alive (EnvError when it cannot start or cannot make the environment)."""
        async with self._start_lock:
            if self.alive:
                return
            hello = frame(HostLoad(self.source.spec, self.source.params))
            try:
                child = await start_child("earl_stream.workers.env_runner", ["--name", self.name], name=self.name,
                                          env=child_environment(), sandbox=self.sandbox,
                                          python_path=self.source.python_path, hello=hello, check=_check_ready)
            except OSError as exc:
                raise EnvError(f"could not start the environment process: {exc}") from None
            ready = _to_worker.decode(child.ready)
            assert isinstance(ready, HostReady)
            self.seed_per_episode, self.starts = ready.seed_per_episode, self.starts + 1
            session = self._session = _Session(child)
            session.reader = asyncio.create_task(self._read(session), name=f"{self.name}-reader")
            log.info("%s started (pid %d, sandbox %s)", self.name, child.proc.pid, self.sandbox.mode.value)

    async def call(self, msg: EnvRequest) -> EnvReply:
        """`msg` answered by the environment in the child; EnvError when it failed, or its child went past a limit
        or died meanwhile."""
        await self.start()
        session = self._session
        assert session is not None and session.child.launch is not None
        session.child.launch.allow_cpu(self.sandbox.limits.cpu_seconds)  # this call's budget, from now on
        call = next(self._ids)
        future: asyncio.Future[EnvAnswer] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        session.pending[call] = future
        try:
            answer = await asyncio.wait_for(_send(session.child, EnvCall(call, msg), future),
                                            self.sandbox.limits.wall_seconds)
        except (ConnectionError, RuntimeError):
            answer = await future  # its end is being read: the reader fails the call with why
        except asyncio.TimeoutError:
            self._kill(session, Breach.WALL)
            answer = await future
        finally:
            session.pending.pop(call, None)
        breach = Breach.MEMORY if answer.out_of_memory else session.child.launch.breach(None) if session.alive else None
        if breach is not None:  # a refused allocation or fork: the child is not trusted again
            self._kill(session, breach)
            if session.reader is not None:  # (its end read back and counted before the episode fails)
                await asyncio.gather(asyncio.shield(session.reader), return_exceptions=True)
            raise EnvError(breach_text(breach, self.sandbox))
        if isinstance(answer.msg, EnvFailed):
            raise EnvError(answer.msg.message)
        return answer.msg

    def _kill(self, session: _Session, why: Breach) -> None:
        session.alive = False  # new calls go to a new child from now on
        assert session.child.launch is not None
        session.child.launch.kill(session.child.proc.pid, why)

    async def _read(self, session: _Session) -> None:
        child = session.child
        try:
            while True:
                answer = _to_worker.decode(await read_frame(child.reader))
                if isinstance(answer, HostReady):
                    continue
                future = session.pending.get(answer.call)
                if future is not None and not future.done():
                    future.set_result(answer)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError) as exc:
            eof = isinstance(exc, asyncio.IncompleteReadError)
            why = "" if eof else f" ({exc})"
        session.alive = False
        code, breach = await end_child(child.proc, child.launch, eof)
        if breach is not None:
            M.ROLLOUT_SANDBOX_BREACHES.labels(self.worker, breach.value).inc()
            reason = f"{breach_text(breach, self.sandbox, self.sandbox.limits.wall_seconds)} (the environment process "\
                     f"{child.proc.pid} was stopped)"
        else:
            reason = f"the environment process {child.proc.pid} exited with code {code}{why}"
        failed = [f for f in session.pending.values() if not f.done()]
        for future in failed:
            future.set_exception(EnvError(reason))
        if failed or breach is not None:
            log.warning("%s: %s; %d calls failed", self.name, reason, len(failed))

    async def aclose(self) -> None:
        """Stop the child: its socket closes and it exits (killed after child_process.GRACE_S if it does not)."""
        session, self._session = self._session, None
        if session is None:
            return
        session.alive = False
        session.child.writer.close()
        if session.reader is not None:
            await asyncio.gather(session.reader, return_exceptions=True)


async def _send(child: Child, call: EnvCall, answered: asyncio.Future[EnvAnswer]) -> EnvAnswer:
    child.writer.write(frame(call))
    await child.writer.drain()  # (within the call's wall limit too: a child that stopped reading fills its socket)
    return await asyncio.shield(answered)


def _check_ready(body: bytes) -> None:
    ready = _to_worker.decode(body)
    if not isinstance(ready, HostReady):
        raise ConnectionError(f"its first frame was {type(ready).__name__}, not ready")
    if ready.error:
        raise ConnectionError(f"the environment could not be made there: {ready.error}")


def _retrieve(future: asyncio.Future[EnvAnswer]) -> None:
    if not future.cancelled():
        future.exception()  # (a call given up, e.g. by a cancelled episode, leaves no "never retrieved" warning)


class SandboxedEnv:
    """One episode of an environment hosted by `runner`'s child: an `Environment` whose options (system prompt,
    turn lengths) are the hosted one's, known after `reset`."""

    def __init__(self, runner: EnvRunner) -> None:
        self.runner = runner
        self.episode = uuid.uuid4().hex
        self.seed_per_episode = runner.seed_per_episode
        self.system_prompt: str | None = None
        self.max_turn_tokens = DEFAULT_MAX_TURN_TOKENS
        self.max_episode_tokens: int | None = None

    async def reset(self, seed: int) -> str:
        opened = await self.runner.call(EnvOpen(episode=self.episode, seed=seed))
        assert isinstance(opened, EnvOpened)
        self.system_prompt, self.max_turn_tokens = opened.system_prompt, opened.max_turn_tokens
        self.max_episode_tokens = opened.max_episode_tokens
        return opened.observation

    async def step(self, action_text: str) -> StepResult:
        stepped = await self.runner.call(EnvStep(episode=self.episode, action=action_text))
        assert isinstance(stepped, EnvStepped)
        return StepResult(stepped.observation, stepped.reward, stepped.done, json.loads(stepped.info_json))

    async def close(self) -> None:
        """Drop the episode's instance in the child (an unfinished episode's is otherwise dropped when idle); a child
        that is gone took it with it."""
        if self.runner.alive:
            await self.runner.call(EnvClose(episode=self.episode))


class EnvRunners:
    """A worker's environment runners: one per environment (spec, params, limits, network), each in `sandbox` with
    the environment's own limits and network (`env_sandbox`) and its own files shown (`EnvSource`)."""

    def __init__(self, worker_id: str, sandbox: SandboxSpec) -> None:
        self.worker_id, self.sandbox = worker_id, sandbox
        self.runners: dict[str, EnvRunner] = {}
        self._sandboxed: dict[str, bool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: set[asyncio.Task[None]] = set()

    def wants(self, spec: EnvSpec) -> bool:
        """Whether `spec`'s episodes run in a runner (`runs_sandboxed`, remembered per spec)."""
        if spec.spec not in self._sandboxed:
            self._sandboxed[spec.spec] = runs_sandboxed(spec.spec)
        return self._sandboxed[spec.spec]

    def runner(self, spec: EnvSpec) -> EnvRunner:
        key = json.dumps([spec.spec, spec.params, sorted(spec.limits.items()), list(spec.network)], sort_keys=True,
                         default=str)
        if key not in self.runners:
            source = EnvSource.of(spec.spec, dict(spec.params))
            box = dataclasses.replace(env_sandbox(self.sandbox, spec.limits, spec.network),
                                      read_only=(*self.sandbox.read_only, *source.read_only))
            self.runners[key] = EnvRunner(source, box, name=f"{self.worker_id}-env-{len(self.runners)}",
                                          worker=self.worker_id)
        return self.runners[key]

    async def envs(self, spec: EnvSpec, n: int) -> list[SandboxedEnv]:
        """`n` episodes' environments of `spec`, their child started (EnvError when it cannot be)."""
        runner = self.runner(spec)
        await runner.start()
        return [SandboxedEnv(runner) for _ in range(n)]

    def attach(self, specs: Iterable[EnvSpec]) -> None:
        """Start the children of `specs` (those that run sandboxed) in the background, ahead of their first episode;
        from any thread once the worker's loop has called it once (a failure is logged, and said again by the
        first episode)."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            if self._loop is None:
                return
            self._loop.call_soon_threadsafe(self.attach, list(specs))
            return
        for spec in specs:
            if self.wants(spec):
                task = asyncio.create_task(self._start(self.runner(spec)))
                self._starting.add(task)
                task.add_done_callback(self._starting.discard)

    async def _start(self, runner: EnvRunner) -> None:
        try:
            await runner.start()
        except EnvError as exc:
            log.warning("%s: %s", runner.name, exc)

    async def aclose(self) -> None:
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        await asyncio.gather(*(r.aclose() for r in self.runners.values()), return_exceptions=True)


def open_env_runners(cfg: RunConfig, worker_id: str) -> EnvRunners | None:
    """The worker's environment runners, in sandboxes per `sandbox.*` (None under `sandbox.mode=none`: environments
    then run in the worker's process)."""
    base = agent_sandbox(cfg, "environments from outside this project")
    if base is None:
        return None
    wall = cfg.sandbox.wall_seconds
    return EnvRunners(worker_id, dataclasses.replace(base, limits=dataclasses.replace(base.limits, wall_seconds=wall)))


# --- the child ---------------------------------------------------------------------------------------------


async def _answer(host: EnvHost, call: EnvCall, writer: asyncio.StreamWriter) -> None:
    try:
        reply, oom = await host.handle(call.msg), False
    except Exception as exc:  # the environment is user code: its failure is its episode's
        reply, oom = failure(exc), out_of_memory(exc)
    writer.write(frame(EnvAnswer(call.call, reply, oom)))


async def _reap(host: EnvHost) -> None:
    while True:
        await asyncio.sleep(min(60.0, host.idle_s))
        host.reap()


async def _serve(fd: int) -> None:
    reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=fd))
    load = _to_child.decode(await read_frame(reader))
    if not isinstance(load, HostLoad):
        raise SystemExit(f"the first frame was {type(load).__name__}, not load")
    try:
        host = EnvHost(load.spec, load.params, idle_s=load.idle_s)
    except Exception as exc:  # (said to the worker, which fails the episodes that wanted it)
        writer.write(frame(HostReady(os.getpid(), error=failure(exc).message)))
        await writer.drain()
        return
    writer.write(frame(HostReady(os.getpid(), seed_per_episode=host.seed_per_episode)))
    running: set[asyncio.Task[None]] = {asyncio.create_task(_reap(host))}
    try:
        while True:
            try:
                msg = _to_child.decode(await read_frame(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the worker went away (or stopped us)
            if isinstance(msg, EnvCall):
                task = asyncio.create_task(_answer(host, msg, writer))
                running.add(task)
                task.add_done_callback(running.discard)
    finally:
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Hosts one environment's instances for a rollout worker (started by it, "
                                 "never by hand): calls and answers over the socket --fd.")
    ap.add_argument("--fd", type=int, required=True, help="the socket inherited from the worker")
    ap.add_argument("--name", default="env-runner", help="the name in log lines")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
