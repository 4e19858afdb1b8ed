"""Environments from outside this project in sandboxed children of the rollout worker: their module's top-level
code, their `reset`/`step` (and the tools they run) never share the worker's process, memory, files or cluster
secret. The worker never imports them.

The worker's side: `EnvRunners` (one per worker, `open_env_runners`; the sandbox mode resolved, and a bwrap fallback
warned of, when the first environment needs it) keeps an `EnvRunner` for each environment that `runs_sandboxed`
picks out from its spec alone (a file, a module or an entry point of another package, or this project's agent
environments whose parameters name such code). Its child loads the environment and says whether it could
(`HostReady.error`: `EnvRunners.check`, at attach time) and whether it is an agent environment. A plain one's
episodes get `SandboxedEnv`s: `Environment`s whose `reset`/`step` go to that child as `EnvCall`s carrying the
messages of `earl_stream.env.host` (no pickles), so the agent loop needs no change; the child serves all the
episodes of its environment, concurrently, until it dies or goes past a limit (the next episode then gets a new
one). An agent environment's child is stopped once it answered: its episodes get `SandboxedAgent`s (its timeout and
seeding as the child reported them) and are made and played in the agent processes (`agent_runner`).

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
import itertools
import json
import logging
import os
import socket
import sys
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from earl_stream import metrics as M
from earl_stream.env import make_env
from earl_stream.env.api import DEFAULT_MAX_TURN_TOKENS, StepResult
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
    opened_observation,
    out_of_memory,
    stepped_result,
)
from earl_stream.env.images import Observation
from earl_stream.env.tools import with_tools
from earl_stream.errors import EnvError
from earl_stream.sandbox import Breach, SandboxMode, SandboxSpec
from earl_stream.workers.agent_sandbox import EnvSource, agent_sandbox, env_sandbox, runs_sandboxed
from earl_stream.workers.child_process import Child, breach_text, child_environment, end_child, frame, read_frame, serve_frames, start_child

if TYPE_CHECKING:
    from earl_stream.config import EnvSpec, RunConfig

__all__ = ["EnvRunner", "EnvRunners", "SandboxedAgent", "SandboxedEnv", "episode_envs", "open_env_runners",
           "runs_sandboxed"]

log = logging.getLogger(__name__)

# the wall-clock limit of one reset or step: below the agent loop's 30 s step timeout, so that the runner, which can
# stop the child, acts first
IDLE_S = 600.0  # an instance whose episode saw no call for this long is dropped in the child (its driver is gone)


class HostLoad(msgspec.Struct, tag="load", frozen=True):
    """The worker's first frame: the environment the child hosts."""
    spec: str
    params: dict[str, Any]
    idle_s: float = IDLE_S


class HostReady(msgspec.Struct, tag="ready", frozen=True):
    """The child's first frame, once its imports are done and an instance was made (else `error` says why, as
    loading it in the worker would have); `agent`: it is an agent environment (`timeout_s`: its episodes')."""
    pid: int
    seed_per_episode: bool = False
    error: str = ""
    agent: bool = False
    timeout_s: float = 0.0


class EnvCall(msgspec.Struct, tag="call", frozen=True):
    call: int
    msg: EnvRequest


class EnvAnswer(msgspec.Struct, tag="answer", frozen=True):
    call: int
    msg: EnvReply
    out_of_memory: bool = False  # the environment's allocation was refused (an address-space limit)


_to_child = msgspec.msgpack.Decoder(HostLoad | EnvCall)
_to_worker = msgspec.msgpack.Decoder(HostReady | EnvAnswer)


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
        self.agent: SandboxedAgent | None = None  # an agent environment's stand-in, once a child said it is one
        self.load_error = ""  # what loading it said when the latest child could not (said again without a new one)
        self.starts = 0  # children started (those that could not load the environment too)
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

    async def start(self, *, retry: bool = False) -> None:
        """Start a child unless one is alive, or the environment was found to be an agent environment (`agent`: the
        child that found it is stopped). EnvError when it cannot start, or cannot load or make the environment
        (then with what loading it said: `load_error`, said again without a new child unless `retry`)."""
        async with self._start_lock:
            if self.alive or self.agent is not None:
                return
            if self.load_error and not retry:
                raise EnvError(self.load_error)
            self.starts += 1
            hello = frame(HostLoad(self.source.spec, self.source.params))
            refused: list[str] = []
            try:
                child = await start_child("earl_stream.workers.env_runner", ["--name", self.name], name=self.name,
                                          env=child_environment(), sandbox=self.sandbox,
                                          python_path=self.source.python_path, hello=hello,
                                          check=lambda body: _check_ready(body, refused))
            except OSError as exc:
                self.load_error = refused[0] if refused else ""
                raise EnvError(self.load_error or f"could not start the environment process: {exc}") from None
            ready = _to_worker.decode(child.ready)
            assert isinstance(ready, HostReady)
            self.seed_per_episode, self.load_error = ready.seed_per_episode, ""
            if ready.agent:  # played by the agent processes, which make it in their own sandboxes
                self.agent = SandboxedAgent(ready.timeout_s, ready.seed_per_episode)
                child.writer.close()
                await end_child(child.proc, child.launch, True)
                log.info("%s: %s is an agent environment (checked in pid %d)", self.name, self.source.spec, ready.pid)
                return
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


def _check_ready(body: bytes, refused: list[str]) -> None:
    ready = _to_worker.decode(body)
    if not isinstance(ready, HostReady):
        raise ConnectionError(f"its first frame was {type(ready).__name__}, not ready")
    if ready.error:
        refused.append(ready.error)
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

    async def reset(self, seed: int) -> str | Observation:
        opened = await self.runner.call(EnvOpen(episode=self.episode, seed=seed))
        assert isinstance(opened, EnvOpened)
        self.system_prompt, self.max_turn_tokens = opened.system_prompt, opened.max_turn_tokens
        self.max_episode_tokens = opened.max_episode_tokens
        return opened_observation(opened, f"the sandboxed environment {self.runner.name}")

    async def step(self, action_text: str) -> StepResult:
        stepped = await self.runner.call(EnvStep(episode=self.episode, action=action_text))
        assert isinstance(stepped, EnvStepped)
        return stepped_result(stepped, f"the sandboxed environment {self.runner.name}")

    async def close(self) -> None:
        """Drop the episode's instance in the child (an unfinished episode's is otherwise dropped when idle); a child
        that is gone took it with it."""
        if self.runner.alive:
            await self.runner.call(EnvClose(episode=self.episode))


class SandboxedAgent:
    """An agent environment from outside this project as the worker holds it: its episodes' `timeout_s` and
    `seed_per_episode`, as its sandboxed child reported them. It is made and run by an agent process
    (`AgentRunners.run`, from its spec), never here: `task` and `run` refuse."""

    def __init__(self, timeout_s: float, seed_per_episode: bool) -> None:
        self.timeout_s, self.seed_per_episode = timeout_s, seed_per_episode

    def task(self, seed: int) -> Any:
        raise EnvError("an agent environment from outside this project runs only in an agent process: set "
                       "rollout.agent_processes >= 1")

    async def run(self, client: Any, task: Any) -> float:
        return self.task(0)


class EnvRunners:
    """A worker's environment runners: one per environment (spec, params, limits, network), each in `sandbox` with
    the environment's own limits and network (`env_sandbox`) and its own files shown (`EnvSource`). `sandbox` is
    made by `make_sandbox` when first needed: the mode is resolved (and a fallback warned of) only once an
    environment runs sandboxed."""

    def __init__(self, worker_id: str, make_sandbox: Callable[[], SandboxSpec]) -> None:
        self.worker_id, self._make_sandbox = worker_id, make_sandbox
        self.runners: dict[str, EnvRunner] = {}
        self._sandbox: SandboxSpec | None = None
        self._sandboxed: dict[str, bool] = {}
        self._starting: set[asyncio.Task[None]] = set()

    @property
    def sandbox(self) -> SandboxSpec:
        if self._sandbox is None:
            self._sandbox = self._make_sandbox()
        return self._sandbox

    def wants(self, spec: EnvSpec) -> bool:
        """Whether `spec`'s episodes run in a runner (`runs_sandboxed`, remembered per spec and params)."""
        key = json.dumps([spec.spec, spec.params], sort_keys=True, default=str)
        if key not in self._sandboxed:
            self._sandboxed[key] = runs_sandboxed(spec.spec, spec.params)
        return self._sandboxed[key]

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

    async def check(self, spec: EnvSpec) -> None:
        """Load `spec` in its sandbox (its child started, kept for its episodes): EnvError with what loading said
        when it cannot be loaded or made (tried again here, e.g. when it is attached again; its episodes are
        refused with that error meanwhile, without a new child each)."""
        await self.runner(spec).start(retry=True)

    async def envs(self, spec: EnvSpec, n: int) -> list[SandboxedEnv] | list[SandboxedAgent]:
        """`n` episodes' environments of `spec`, their child started (EnvError when it cannot be); an agent
        environment's stand-ins (`SandboxedAgent`) for the agent processes."""
        runner = self.runner(spec)
        await runner.start()
        if runner.agent is not None:
            return [runner.agent] * n
        return [SandboxedEnv(runner) for _ in range(n)]

    def attach(self, specs: Iterable[EnvSpec]) -> None:
        """Start the children of `specs` (those that run sandboxed) in the background, ahead of their first episode,
        from the worker's loop (a failure is logged, and said again by the first episode)."""
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


async def episode_envs(runners: EnvRunners | None, spec: EnvSpec, n: int) -> list[Any]:
    """`n` episodes' environments of `spec`, wherever its code may run: in its sandbox when it comes from outside this
    project (`runners.wants`), else made here (the training episodes, evaluation and the synchronous loop all take
    theirs from here, so none imports another project's code in-process). EnvError when they cannot be made."""
    if runners is not None and runners.wants(spec):
        return list(await runners.envs(spec, n))
    return [with_tools(make_env(spec.spec, spec.params)) for _ in range(n)]


def open_env_runners(cfg: RunConfig, worker_id: str) -> EnvRunners | None:
    """The worker's environment runners, in sandboxes per `sandbox.*` (None under `sandbox.mode=none`: environments
    then run in the worker's process). Where bwrap cannot run, the fallback is warned of when the first sandboxed
    environment is opened, not before."""
    if SandboxMode(cfg.sandbox.mode) is SandboxMode.NONE:
        agent_sandbox(cfg, "environments from outside this project")  # (says so)
        return None

    def make_sandbox() -> SandboxSpec:
        base = agent_sandbox(cfg, "environments from outside this project")
        assert base is not None, "not under sandbox.mode=none"
        limits = dataclasses.replace(base.limits, wall_seconds=cfg.sandbox.wall_seconds)
        return dataclasses.replace(base, limits=limits)

    return EnvRunners(worker_id, make_sandbox)


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
    writer.write(frame(HostReady(os.getpid(), seed_per_episode=host.seed_per_episode, agent=host.agent,
                                 timeout_s=host.timeout_s)))
    reaper = asyncio.create_task(_reap(host))

    def dispatch(msg: HostLoad | EnvCall) -> tuple[int, Coroutine[Any, Any, None]] | None:
        return (msg.call, _answer(host, msg, writer)) if isinstance(msg, EnvCall) else None

    try:
        await serve_frames(reader, _to_child.decode, dispatch, {})
    finally:
        reaper.cancel()


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
