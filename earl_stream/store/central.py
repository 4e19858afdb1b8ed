"""Central dispatch mode (`store.dispatch=central`): every byte of a step goes through one process.

Kept to measure, side by side, what the layout-aware pull saves: single-controller RL systems gather
a step's data in one driver and scatter it from there. Owns `CentralDispatcher` (a shard node that,
on GATHER, pulls every claimed row of a step whole from its producers, keeps the rows under
`c/{step}/{key}`, and serves consumers their parts with the usual PULL / PULL_SHM), `CentralClient`
(a drop-in for `ShardClient` in `pull_samples` that routes a claimed step's sample pulls through the
dispatcher), `pull_samples_central`, and `start_dispatcher_process` (the dispatcher in its own
process). Partitioning is unchanged (`layout.py`): only the path of the bytes differs.

Lost producers: rows the dispatcher could not fetch are absent there, so consumers get the same
`SamplesUnavailable` naming exactly those samples as in pull mode.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from earl_stream.errors import StoreError
from earl_stream.records import IMAGES, ROUTED_EXPERTS, images_info, routing_info
from earl_stream.store import wire
from earl_stream.store.client import PeerUnreachable, Piece, RemoteError, ShardClient
from earl_stream.store.experience import pull_samples
from earl_stream.store.node import ShardNode
from earl_stream.store.schema import SampleMeta, sample_key
from earl_stream.store.shards import RequestError
from earl_stream.store.wire import ErrorCode, Kind

log = logging.getLogger(__name__)
CENTRAL_PREFIX = "c/"


def central_key(step: int, key: str) -> str:
    """Where the dispatcher keeps producer key `key` of step `step`."""
    return f"{CENTRAL_PREFIX}{int(step)}/{key}"


@dataclass
class _Step:
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)


class CentralDispatcher:
    """The one process all of a step's bytes pass through. Thread-safe; `close` when done.

    `keep_steps`: how many most recent steps stay held (older ones are dropped when a newer step is
    gathered, or explicitly with DROP); other arguments as `ShardNode`'s and `ShardClient`'s.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        keep_steps: int = 2,
        shm: bool | None = None,
        shm_max_bytes: int = 4 << 30,
        timeout_s: float = 120.0,
        max_parallel_peers: int = 8,
    ) -> None:
        if keep_steps < 1:
            raise StoreError(f"keep_steps={keep_steps} must be >= 1")
        self._client = ShardClient(secret=secret, timeout_s=timeout_s, max_parallel_peers=max_parallel_peers)
        self._pool = ThreadPoolExecutor(max_parallel_peers, thread_name_prefix="central-gather")
        self._keep = keep_steps
        self._steps: dict[int, _Step] = {}
        self._lock = threading.Lock()
        handlers: dict[type[msgspec.Struct], Callable[[Any], msgspec.Struct]] = {
            wire.GatherRequest: self._gather, wire.DropRequest: self._drop}
        self.node = ShardNode(host, port, secret=secret, shm=shm, shm_max_bytes=shm_max_bytes, handlers=handlers)
        self.address = self.node.address

    def close(self) -> None:
        self.node.close()
        self._pool.shutdown(wait=True)
        self._client.close()

    def __enter__(self) -> CentralDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _step(self, step: int) -> _Step:
        with self._lock:
            state = self._steps.get(step)
            if state is None:
                state = self._steps[step] = _Step()
                for old in [s for s in self._steps if s <= step - self._keep]:
                    del self._steps[old]
                    self.node.drop_prefix(f"{CENTRAL_PREFIX}{old}/")
            return state

    def _gather(self, request: wire.GatherRequest) -> wire.GatherReply:
        state = self._step(request.step)
        with state.lock:  # the first consumer of a step gathers it; the others wait here, then find it done
            todo: dict[str, list[Piece]] = {}
            for address, pieces in request.sources:
                for key, start, end in pieces:
                    if key not in state.done and key not in state.missing:
                        todo.setdefault(address, []).append((key, start, end))
            futures = [self._pool.submit(self._fetch, request.step, address, pieces, state) for address, pieces in todo.items()]
            for fut in futures:
                fut.result()
            wanted = {key for _, pieces in request.sources for key, _, _ in pieces}
            return wire.GatherReply(len(state.done), sorted(wanted & state.missing))

    def _fetch(self, step: int, address: str, pieces: list[Piece], state: _Step) -> None:
        """Pull `pieces` from one producer and keep them; what cannot be had is recorded as missing."""
        try:
            self._store(step, pieces, address, state)
            return
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_KEY:
                raise RequestError(exc.code, f"gathering from {address}: {exc}") from exc
        except PeerUnreachable as exc:
            log.warning("central dispatcher: step %d: producer %s unreachable: %s", step, address, exc)
            state.missing.update(key for key, _, _ in pieces)
            return
        except StoreError as exc:
            raise RequestError(ErrorCode.INTERNAL, f"gathering from {address}: {exc}") from exc
        for piece in pieces:  # the producer lacks some keys: find out which
            try:
                self._store(step, [piece], address, state)
            except (RemoteError, PeerUnreachable):
                state.missing.add(piece[0])

    def _store(self, step: int, pieces: list[Piece], address: str, state: _Step) -> None:
        # Read in place from the producer (same host) and copied once, into this node's own segments.
        arrays = self._client.pull(address, pieces, zero_copy=True)
        self.node.put_many({central_key(step, key): arr for (key, _, _), arr in zip(pieces, arrays)})
        state.done.update(key for key, _, _ in pieces)

    def _drop(self, request: wire.DropRequest) -> wire.DropReply:
        if not request.prefix.startswith(CENTRAL_PREFIX):
            raise RequestError(ErrorCode.BAD_RANGE, f"a dispatcher only drops keys under {CENTRAL_PREFIX!r}")
        return wire.DropReply(self.node.drop_prefix(request.prefix))


class CentralClient:
    """Routes the pulls of a claimed step through a `CentralDispatcher`; pass it to `pull_samples`.

    Call `set_step(step, claim)` with the step's whole claim (the same metadata on every rank) before
    pulling. Pulls of sample keys (`s/...`) then first ask the dispatcher to gather the whole claim
    (every row whole, the requested fields), and fetch this rank's part from it. Other pulls (weights)
    go straight to their peer through the wrapped client.
    """

    def __init__(self, client: ShardClient, dispatcher: str, *, gather_chunk: int = 8192) -> None:
        self._client = client
        self.dispatcher = dispatcher
        self._chunk = gather_chunk
        self._step: int | None = None
        self._claim: list[SampleMeta] = []
        self._gathered: set[str] = set()  # fields gathered for the current step

    def set_step(self, step: int, claim: Sequence[SampleMeta]) -> None:
        if step != self._step:
            self._gathered = set()
        self._step, self._claim = int(step), list(claim)

    def gather(self, fields: Sequence[str], *, timeout_s: float | None = None) -> list[str]:
        """Have the dispatcher hold `fields` of every claimed row; returns keys it could not fetch."""
        if self._step is None:
            raise StoreError("CentralClient.set_step(step, claim) must come before pulling samples")
        new = [f for f in dict.fromkeys(fields) if f not in self._gathered]
        missing: list[str] = []
        pieces = [(m.producer_address, (sample_key(m.sample_id, f), 0, n)) for m in self._claim for f in new
                  if (n := _stored_elements(m, f)) is not None]
        for i in range(0, len(pieces), self._chunk):
            sources: dict[str, list[Piece]] = {}
            for address, piece in pieces[i : i + self._chunk]:
                sources.setdefault(address, []).append(piece)
            request = wire.GatherRequest(self._step, list(sources.items()))
            reply = self._client.call(self.dispatcher, request, Kind.GATHER_REPLY, timeout_s=timeout_s)
            missing.extend(reply.missing)
        if missing:
            log.warning("step %d: the dispatcher could not fetch %d shard(s), e.g. %s", self._step, len(missing), missing[:3])
        self._gathered.update(new)
        return missing

    def pull(
        self,
        address: str,
        pieces: Sequence[Piece],
        *,
        timeout_s: float | None = None,
        zero_copy: bool = False,
        merge_runs: bool = False,
    ) -> list[np.ndarray]:
        return self.pull_many({address: pieces}, timeout_s=timeout_s, zero_copy=zero_copy, merge_runs=merge_runs)[address]

    def pull_many(
        self,
        requests: Mapping[str, Sequence[Piece]],
        *,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
        zero_copy: bool = False,
        merge_runs: bool = False,
    ) -> dict[str, Any]:
        """As `ShardClient.pull_many`; sample pieces come from the dispatcher, one request for all."""
        opts: dict[str, Any] = {"timeout_s": timeout_s, "zero_copy": zero_copy, "merge_runs": merge_runs}
        if not any(key.startswith("s/") for pieces in requests.values() for key, _, _ in pieces):
            return self._client.pull_many(requests, return_exceptions=return_exceptions, **opts)
        fields = {key.rsplit("/", 1)[1] for pieces in requests.values() for key, _, _ in pieces}
        self.gather(sorted(fields), timeout_s=timeout_s)
        assert self._step is not None
        step = self._step
        routed = {a: [(central_key(step, k), s, e) for k, s, e in pieces] for a, pieces in requests.items()}
        flat = [p for pieces in routed.values() for p in pieces]
        try:
            arrays = self._client.pull(self.dispatcher, flat, **opts)
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_KEY:
                raise
            # Some rows were lost: answer per producer, so the caller can tell whose.
            out = {a: self._guarded(a, pieces, opts) for a, pieces in routed.items()}
            errors = [r for r in out.values() if isinstance(r, StoreError)]
            if errors and not return_exceptions:
                raise errors[0] from None
            return out
        out, i = {}, 0
        for address, pieces in routed.items():
            n = _count_runs(pieces) if merge_runs else len(pieces)
            out[address] = arrays[i : i + n]
            i += n
        return out

    def _guarded(self, address: str, pieces: list[Piece], opts: dict[str, Any]) -> Any:
        try:
            return self._client.pull(self.dispatcher, pieces, **opts)
        except RemoteError as exc:
            return RemoteError(address, exc.code, f"via dispatcher {self.dispatcher}: {exc}")
        except StoreError as exc:
            return exc

    def release(self, step: int, *, timeout_s: float | None = None) -> int:
        """Drop step `step` at the dispatcher (it also drops old steps by itself); returns bytes freed."""
        request = wire.DropRequest(f"{CENTRAL_PREFIX}{int(step)}/")
        return int(self._client.call(self.dispatcher, request, Kind.DROP_REPLY, timeout_s=timeout_s).freed)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> CentralClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stored_elements(meta: SampleMeta, name: str) -> int | None:
    """Elements the producer stores for field `name` of this row (routed_experts: T x layers x top_k; images:
    the bytes of its PNGs; None for a row without them, which no consumer pulls them for)."""
    if name == IMAGES:
        described = images_info(json.loads(meta.info_json))
        return None if described is None else sum(span[4] for span in described[0])
    if name != ROUTED_EXPERTS:
        return meta.total_tokens
    found = routing_info(json.loads(meta.info_json))
    return None if found is None else meta.total_tokens * found[1]


def _count_runs(pieces: Sequence[Piece]) -> int:
    return sum(1 for i, p in enumerate(pieces) if i == 0 or pieces[i - 1][0] != p[0])


def pull_samples_central(
    central: CentralClient,
    step: int,
    claim: Sequence[SampleMeta],
    metas: Sequence[SampleMeta],
    fields: Sequence[str],
    token_ranges: Mapping[int, list[tuple[int, int]]] | None = None,
    *,
    dtypes: Mapping[str, np.dtype] | None = None,
    zero_copy: bool = False,
) -> list[dict[str, np.ndarray]]:
    """`pull_samples` of `metas` (this rank's rows of `claim`), routed through the dispatcher."""
    central.set_step(step, claim)
    return pull_samples(central, metas, fields, token_ranges, dtypes=dtypes, zero_copy=zero_copy)


class DispatcherProcess:
    """A `CentralDispatcher` running in a child process (spawned); `stop` ends it."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection, address: str) -> None:
        self.process, self._conn, self.address = process, conn, address

    def stop(self, timeout_s: float = 10.0) -> None:
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()


def start_dispatcher_process(host: str = "127.0.0.1", *, secret: bytes | None = None, timeout_s: float = 60.0,
                             **kwargs: Any) -> DispatcherProcess:
    """Start a dispatcher in its own process and return once it serves (kwargs: `CentralDispatcher`'s)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_dispatcher_main, args=(child, host, secret, kwargs), name="central-dispatcher", daemon=True)
    process.start()
    child.close()
    if not parent.poll(timeout_s):
        process.kill()
        raise StoreError(f"central dispatcher did not start within {timeout_s:g}s")
    try:
        address = parent.recv()
    except EOFError:
        process.join()
        raise StoreError(f"central dispatcher exited at start (exit code {process.exitcode})") from None
    return DispatcherProcess(process, parent, address)


def _dispatcher_main(conn: Connection, host: str, secret: bytes | None, kwargs: dict[str, Any]) -> None:
    with CentralDispatcher(host, secret=secret, **kwargs) as dispatcher:
        conn.send(dispatcher.address)
        try:
            conn.recv()  # "stop", or EOF when the parent died
        except EOFError:
            pass
