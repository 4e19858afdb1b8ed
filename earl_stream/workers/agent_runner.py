"""Agent programs in processes of their own: an agent environment's `run(client, task)` (the user's code
and the Python of its `openai` client, several milliseconds a request) runs in a child of the rollout
worker, so it does not take turns with the engine's batcher on the worker's event loop and core.

The worker's side is `AgentRunner`: it starts the child on first use, sends each episode as an
`AgentJob` (the environment's registry spec and params, the seed, the endpoint's URL, the episode's
agent key as bearer token, the episode's id, the timeout) over a socket pair, and waits for its `AgentDone` (the reward, or why it
failed). The child (`python -m earl_stream.workers.agent_runner --fd N`) first answers `AgentReady` once its
imports are done (an episode's timeout never counts the child's start-up), then makes the environment for each
episode as the worker would, runs it with an `openai.AsyncOpenAI` client whose requests carry the
episode's key, and answers. The endpoint, the token accounting and the sample stay in the worker
(`earl_stream.workers.agent_episode`). A child that dies fails only the episodes it was running; the
next episode starts a new child. What the agent prints goes to the worker's log. The child's environment
holds no cluster secret (`agent_environment`).

Sandboxed (`sandbox.*`; `open_agent_runners`, `agent_sandbox`): the child starts in a sandbox
(`earl_stream.sandbox`) that shows it only the interpreter, the packages and its environment's code, with no
network: it reaches the endpoint through a Unix socket (`AgentJob.uds`). Before each episode its CPU limit moves
to what it used plus `sandbox.cpu_seconds`; a child that goes past a limit fails its episodes with
`sandbox_limit: <limit>` (`breach_text`).

Frames: a 4-byte big-endian length, then a msgpack-encoded message; starting and ending the child is
`earl_stream.workers.child_process`'s, shared with the environment runner (`env_runner`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import itertools
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Coroutine, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from earl_stream import metrics as M
from earl_stream.sandbox import Launch, SandboxSpec
from earl_stream.workers.agent_loop import EpisodeFailed
from earl_stream.workers.agent_sandbox import EnvSource, agent_sandbox, env_sandbox
from earl_stream.workers.child_process import GRACE_S, breach_text, child_environment, end_child, read_frame, serve_frames, start_child
from earl_stream.workers.child_process import frame as _frame

if TYPE_CHECKING:
    from earl_stream.config import RunConfig
    from earl_stream.openai_api import OpenAIEndpoint

log = logging.getLogger(__name__)

__all__ = ["GRACE_S", "AgentRunner", "AgentRunners", "breach_text", "open_agent_runners", "run_agent"]


class AgentJob(msgspec.Struct, tag="job", frozen=True):
    job: int
    spec: str  # the environment's registry spec, made in the child with `params`
    params: dict[str, Any]
    seed: int
    url: str  # the worker's OpenAI endpoint
    api_key: str
    episode_key: str  # sent as the episode header with every request of the episode
    timeout_s: float
    ca_pem: str = ""  # under TLS: the CA certificate the endpoint's certificate is signed by
    uds: str = ""  # the endpoint's Unix socket, in a sandbox without a network (`url` then names only the path)


class AgentCancel(msgspec.Struct, tag="cancel", frozen=True):
    job: int


class AgentDone(msgspec.Struct, tag="done", frozen=True):
    job: int
    reward: float = 0.0
    error: str = ""  # non-empty: the episode failed, and why


class AgentReady(msgspec.Struct, tag="ready", frozen=True):
    """The child's first frame, once its imports are done: episodes' timeouts run from here on."""
    pid: int


_to_child = msgspec.msgpack.Decoder(AgentJob | AgentCancel)
_to_worker = msgspec.msgpack.Decoder(AgentDone | AgentReady)


def agent_environment() -> dict[str, str]:
    """The agent process's environment: the worker's, less the cluster secret's and the TLS key's variables
    (`child_process.child_environment`). Its programs get each episode's agent key instead (openai_api/auth.py)."""
    return child_environment()


def _check_ready(body: bytes) -> None:
    ready = _to_worker.decode(body)
    if not isinstance(ready, AgentReady):
        raise ConnectionError(f"its first frame was {type(ready).__name__}, not ready")


class AgentRunner:
    """One child process that runs agent episodes, any number at a time (asyncio tasks there)."""

    def __init__(self, name: str = "agent-runner", sandbox: SandboxSpec | None = None, worker: str = "",
                 python_path: tuple[str, ...] = ()) -> None:
        self.name, self.sandbox, self.worker, self.python_path = name, sandbox, worker or name, python_path
        self._launch: Launch | None = None
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[AgentDone]] = {}
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._alive = False
        self._start_lock = asyncio.Lock()
        self.starts = 0

    @property
    def load(self) -> int:
        """Episodes running in the child now."""
        return len(self._pending)

    async def _ensure_started(self) -> None:
        async with self._start_lock:
            if self._alive:
                return
            child = await start_child("earl_stream.workers.agent_runner", ["--name", self.name], name=self.name,
                                      env=agent_environment(), sandbox=self.sandbox, python_path=self.python_path,
                                      check=_check_ready)
            self._proc, self._writer, self._alive, self._launch = child.proc, child.writer, True, child.launch
            self.starts += 1
            self._reader_task = asyncio.create_task(self._read(child.reader, child.proc, child.launch),
                                                    name=f"{self.name}-reader")
            log.info("%s started (pid %d%s)", self.name, child.proc.pid,
                     f", sandbox {self.sandbox.mode.value}" if self.sandbox is not None else "")

    async def _read(self, reader: asyncio.StreamReader, proc: asyncio.subprocess.Process,
                    launch: Launch | None) -> None:
        try:
            while True:
                done = _to_worker.decode(await read_frame(reader))
                if isinstance(done, AgentReady):
                    continue
                future = self._pending.get(done.job)
                if future is not None and not future.done():
                    future.set_result(done)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError) as exc:
            eof, why = isinstance(exc, asyncio.IncompleteReadError), f" ({exc})"
        self._alive = False  # from here on, new episodes go to a new child
        failed = [f for f in self._pending.values() if not f.done()]  # this child's, taken before any await
        code, breach = await end_child(proc, launch, eof)
        why = "" if eof else why
        if breach is not None:
            M.ROLLOUT_SANDBOX_BREACHES.labels(self.worker, breach.value).inc()
            why = f"{why}: {breach_text(breach, self.sandbox)}"
        for future in failed:
            if not future.done():  # (one may have timed out or been cancelled meanwhile)
                future.set_exception(EpisodeFailed(f"the agent process exited with code {code}{why}"))
        if failed:
            log.warning("%s (pid %d) exited with code %s%s: %d episodes failed", self.name, proc.pid, code, why, len(failed))

    async def run(self, spec: str, params: dict[str, Any], seed: int, *, url: str, api_key: str, episode_key: str,
                  timeout_s: float, ca_pem: str = "", uds: str = "") -> float:
        """Play one episode in the child; returns its reward or raises `EpisodeFailed`."""
        try:
            await self._ensure_started()
        except OSError as exc:
            raise EpisodeFailed(f"could not start the agent process: {exc}") from None
        assert self._writer is not None
        if self._launch is not None and self.sandbox is not None:
            self._launch.allow_cpu(self.sandbox.limits.cpu_seconds)  # this episode's budget, from now on
        job = next(self._ids)
        future: asyncio.Future[AgentDone] = asyncio.get_running_loop().create_future()
        self._pending[job] = future
        try:
            self._writer.write(_frame(AgentJob(job, spec, dict(params), seed, url, api_key, episode_key, timeout_s,
                                               ca_pem, uds)))
            await self._writer.drain()
            done = await asyncio.wait_for(future, timeout_s + GRACE_S)
        except (ConnectionError, RuntimeError) as exc:
            raise EpisodeFailed(f"could not reach the agent process: {exc}") from None
        except asyncio.TimeoutError:
            self._cancel(job)
            raise EpisodeFailed(f"the agent ran longer than {timeout_s:.0f}s (its process did not answer)") from None
        except asyncio.CancelledError:
            self._cancel(job)
            raise
        finally:
            self._pending.pop(job, None)
        if done.error:
            raise EpisodeFailed(done.error)
        return done.reward

    def _cancel(self, job: int) -> None:
        if self._alive and self._writer is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._writer.write(_frame(AgentCancel(job)))

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Stop the child: its socket closes, it cancels what it runs and exits (killed if it does not)."""
        proc, self._alive = self._proc, False
        if self._writer is not None:
            self._writer.close()
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)
        elif self._launch is not None:
            self._launch.cleanup()


class AgentRunners:
    """`n` children (`rollout.agent_processes`); each episode goes to the least loaded one. In a sandbox
    (`sandbox.*`, `agent_sandbox`) there are `n` for each set of files environments need to see (`EnvSource`: their
    code and the paths their parameters name), and they reach the worker's OpenAI endpoint only through its Unix
    socket `endpoint_socket`, whose folder is all of the worker they can write to."""

    def __init__(self, n: int, worker_id: str, sandbox: SandboxSpec | None = None, endpoint_socket: str = "") -> None:
        if sandbox is not None and not endpoint_socket:
            raise ValueError("sandboxed agent processes reach the endpoint by its Unix socket: pass endpoint_socket")
        self.n, self.worker_id, self.sandbox, self.endpoint_socket = n, worker_id, sandbox, endpoint_socket
        self.pools: dict[tuple[Any, ...], list[AgentRunner]] = {}  # by what they see and their limits

    @property
    def runners(self) -> list[AgentRunner]:
        return [r for pool in self.pools.values() for r in pool]

    def _pool(self, source: EnvSource, limits: Mapping[str, float], network: Sequence[str]) -> list[AgentRunner]:
        view = (*source.view, tuple(sorted(limits.items())), tuple(network)) if self.sandbox is not None else ()
        if view not in self.pools:
            box = None
            if self.sandbox is not None:
                box = dataclasses.replace(env_sandbox(self.sandbox, limits, network),
                                          read_only=(*self.sandbox.read_only, *source.read_only),
                                          writable=(*self.sandbox.writable, os.path.dirname(self.endpoint_socket)))
            first = len(self.runners)
            self.pools[view] = [AgentRunner(f"{self.worker_id}-agents-{first + i}", box, self.worker_id,
                                            source.python_path) for i in range(self.n)]
        return self.pools[view]

    async def run(self, spec: str, params: dict[str, Any], seed: int, *, limits: Mapping[str, float] | None = None,
                  network: Sequence[str] = (), **kw: Any) -> float:
        """One episode of environment `spec` (`params`) in a child; `limits` and `network`: the environment's own
        (`EnvSpec.limits`, `EnvSpec.network`) over the sandbox's."""
        if self.sandbox is None:
            pool = self._pool(EnvSource(spec, params), {}, ())
        else:  # the endpoint by its socket (plain HTTP); code references made absolute
            source = EnvSource.of(spec, params)
            pool, spec, params = self._pool(source, limits or {}, network), source.spec, source.params
            kw.update(url="http://localhost/v1", ca_pem="", uds=self.endpoint_socket)
        return await min(pool, key=lambda r: r.load).run(spec, params, seed, **kw)

    async def aclose(self) -> None:
        await asyncio.gather(*(r.aclose() for r in self.runners), return_exceptions=True)
        if self.endpoint_socket:
            shutil.rmtree(os.path.dirname(self.endpoint_socket), ignore_errors=True)


async def open_agent_runners(cfg: RunConfig, worker_id: str, endpoint: OpenAIEndpoint) -> AgentRunners:
    """The worker's agent processes (`rollout.agent_processes`), in sandboxes per `sandbox.*`: then the endpoint also
    serves on a Unix socket in a folder of its own (removed by `aclose`), the one path of the worker they see."""
    sandbox = agent_sandbox(cfg)
    if sandbox is None:
        return AgentRunners(cfg.rollout.agent_processes, worker_id)
    folder = tempfile.mkdtemp(prefix="earl-agents-")
    os.chmod(folder, 0o755)  # (uid 65534 connects to the socket inside)
    path = os.path.join(folder, "openai.sock")
    await endpoint.serve_unix(path)
    log.info("agent programs run in sandboxes (%s) and reach the endpoint by %s", sandbox.mode.value, path)
    return AgentRunners(cfg.rollout.agent_processes, worker_id, sandbox, path)


# --- the child ---------------------------------------------------------------------------------------------


_clients: dict[tuple[str, str, str], Any] = {}


def episode_client(url: str, api_key: str, episode_key: str, timeout_s: float, ca_pem: str = "",
                   uds: str = "") -> Any:
    """An `openai.AsyncOpenAI` client on the endpoint at `url` (through the Unix socket `uds` where given), its
    requests filed under `episode_key` and authorised by `api_key` (the episode's agent key); under TLS it trusts
    only `ca_pem`.

    Every episode's client is a copy of one client per endpoint, sharing its connection pool: a new
    client builds an SSL context (~30 ms here), which would cost more than a short turn.
    """
    from earl_stream.openai_api import EPISODE_HEADER

    try:
        import openai
    except ImportError:
        raise EpisodeFailed("agent environments need the openai package (pip install 'earl_stream[agents]')") from None
    base = _clients.get((url, ca_pem, uds))
    if base is None or base.is_closed():
        from earl_stream.security.tls import client_context  # (only under TLS: the child starts faster without it)

        http_client = None
        if uds:  # the transport of the HTTP library openai's client is built on (httpx, or httpx2 in newer ones)
            base_client = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
            library = importlib.import_module(base_client.__module__.split(".")[0])
            http_client = openai.DefaultAsyncHttpxClient(transport=library.AsyncHTTPTransport(uds=uds))
        elif ca_pem:
            http_client = openai.DefaultAsyncHttpxClient(verify=client_context(ca_pem))
        base = _clients[(url, ca_pem, uds)] = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0,
                                                                 http_client=http_client)
    return base.with_options(api_key=api_key, timeout=timeout_s, default_headers={EPISODE_HEADER: episode_key})


async def run_agent(env: Any, seed: int, url: str, api_key: str, episode_key: str, timeout_s: float,
                    ca_pem: str = "", uds: str = "") -> float:
    """`env.run(client, env.task(seed))` with an episode client, its reward; any failure is `EpisodeFailed`."""
    try:
        task = env.task(seed)
    except Exception as exc:  # the environment's own code
        raise EpisodeFailed(f"agent task({seed}) raised {type(exc).__name__}: {exc}") from None
    client = episode_client(url, api_key, episode_key, timeout_s, ca_pem, uds)
    try:
        return float(await asyncio.wait_for(env.run(client, task), timeout_s))
    except asyncio.TimeoutError:
        raise EpisodeFailed(f"the agent ran longer than {timeout_s:.0f}s") from None
    except Exception as exc:  # an agent is user code: any error fails only its episode
        raise EpisodeFailed(f"the agent raised {type(exc).__name__}: {exc}") from None


async def _episode(job: AgentJob, writer: asyncio.StreamWriter) -> None:
    from earl_stream.env import make_env

    try:
        env = make_env(job.spec, job.params)
        done = AgentDone(job.job, reward=await run_agent(env, job.seed, job.url, job.api_key, job.episode_key,
                                                         job.timeout_s, job.ca_pem, job.uds))
    except EpisodeFailed as exc:
        done = AgentDone(job.job, error=str(exc))
    except Exception as exc:  # the environment's constructor is user code too
        done = AgentDone(job.job, error=f"the agent environment {job.spec!r} raised {type(exc).__name__}: {exc}")
    writer.write(_frame(done))


async def _serve(fd: int) -> None:
    reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=fd))
    import earl_stream.env  # noqa: F401  (what every episode needs, imported before the worker is told ready)
    with contextlib.suppress(ImportError):  # (without it each agent episode fails with the reason)
        import openai  # noqa: F401
    writer.write(_frame(AgentReady(os.getpid())))
    await writer.drain()
    running: dict[Hashable, asyncio.Task[None]] = {}

    def dispatch(msg: AgentJob | AgentCancel) -> tuple[int, Coroutine[Any, Any, None]] | None:
        if isinstance(msg, AgentJob):
            return msg.job, _episode(msg, writer)
        task = running.get(msg.job)
        if task is not None:
            task.cancel()
        return None

    try:
        await serve_frames(reader, _to_child.decode, dispatch, running)
    finally:
        for client in _clients.values():
            with contextlib.suppress(Exception):
                await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Runs agent environments' episodes for a rollout worker (started by "
                                 "it, never by hand): jobs and results over the socket --fd.")
    ap.add_argument("--fd", type=int, required=True, help="the socket inherited from the worker")
    ap.add_argument("--name", default="agent-runner", help="the name in log lines")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2", "httpcore", "openai"):  # a line for every request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        asyncio.run(_serve(args.fd))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
