"""The UCX transport of the shard data plane (through `ucxx`, when it is installed), and the choice of transport.

Owns the names of the transports a `ShardClient` may use (`TRANSPORTS`, `check_transport`), this
process's one UCX worker (`UcxWorker`: a context, a worker progressed by whoever waits on it,
endpoints made from peers' worker addresses), and the sending (`send_pieces`, the node's side of
PULL_UCX) and receiving (`recv_pieces`, the client's) of pieces. The TCP connection of a peer pair stays the control
channel (auth, requests, piece tables with crc32); only the piece bytes move over UCX, piece i as
one tag message tagged `tag + i` (the client picks `tag`, so tags never collide on its worker).

Worker addresses are exchanged over that authenticated connection, never through a UCX listener
(listener endpoints only ever use TCP; an address lets UCX pick shared memory or RDMA). Endpoints are
made with `endpoint_error_handling=False` (needed for UCX's shared-memory transports), so UCX does
not detect dead peers: every wait here is bounded by the caller's deadline, and liveness comes from
the TCP connection and the control plane. Set `UCX_TLS` to restrict UCX's own transports.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from earl_stream.errors import StoreError

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "tcp", "ucx")
"""auto: shared memory with same-host peers, else UCX when both sides have it, else TCP; shm: shared
memory with same-host peers, else TCP (no UCX); tcp: TCP only; ucx: UCX with every peer (StoreError
where it cannot be used)."""
MAX_PIECES = 1 << 20  # pieces per request: the low 20 bits of a tag number the piece
_IMPORT_ERROR: str | None = None
try:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as _ucx
    from ucxx._lib.arr import Array as _Array
except Exception as exc:  # ImportError, or a missing shared library (OSError) of a broken install
    _ucx = None
    _Array = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def ucx_available() -> bool:
    """True when `ucxx` imports in this process."""
    return _ucx is not None


def ucx_import_error() -> str | None:
    """Why `ucxx` does not import here (None when it does)."""
    return _IMPORT_ERROR


def check_transport(name: str) -> str:
    """Validate a transport name; asking for 'ucx' where `ucxx` is missing is a StoreError saying why."""
    if name not in TRANSPORTS:
        raise StoreError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")
    if name == "ucx" and _ucx is None:
        raise StoreError(
            f"transport 'ucx' was asked for but ucxx does not import here ({_IMPORT_ERROR}); install the "
            "'ucx' extra (pip install 'earl_stream[ucx]', i.e. ucxx-cu12) or choose transport auto, shm or tcp"
        )
    return name


class UcxWorker:
    """This process's UCX context and worker. Thread-safe: every call into UCX holds `lock`.

    No progress thread: UCX's blocking progress mode missed wake-ups of its shared-memory transports
    here (transfers stalled for good), and a polling thread would burn a core in every process. Each
    transfer has a waiter on both sides (the node's serving thread, the pulling thread), and waiters
    progress the worker (`wait_all`).
    """

    def __init__(self) -> None:
        if _ucx is None:
            raise StoreError(f"ucxx is not available: {_IMPORT_ERROR}")
        try:
            self._context = _ucx.UCXContext(feature_flags=(_ucx.Feature.TAG,))
            self._worker = _ucx.UCXWorker(self._context)
            self.address: bytes = self._worker.address.tobytes()
        except Exception as exc:  # ucxx's UCXError family: no usable UCX transport on this host
            raise StoreError(f"cannot start a UCX worker: {exc}") from exc
        self.lock = threading.RLock()
        self._next_tag = 1

    def endpoint(self, peer_address: bytes) -> Any:
        """An endpoint to the worker whose address is `peer_address`, with peer error handling: without it
        UCX aborts this whole process when the peer dies mid-transfer (a killed rollout worker took its
        puller down: tests/store/test_transport_contract.py). It costs bandwidth where UCX would have used
        its shared-memory transports (one host, 256 MiB pulls: 0.36-0.51 GB/s against 0.85-0.98 without);
        the client prefers its own shm transport with same-host peers, so UCX carries cross-host pulls."""
        try:
            with self.lock:
                addr = _ucx.UCXAddress.create_from_buffer(bytes(peer_address))
                return _ucx.UCXEndpoint.create_from_worker_address(self._worker, addr, endpoint_error_handling=True)
        except Exception as exc:  # ucxx raises its own UCXError family
            raise StoreError(f"cannot create a UCX endpoint to the peer's worker: {exc}") from exc

    def new_tag(self) -> int:
        """A tag base unused on this worker: pieces of one request use tag + 0 .. tag + MAX_PIECES - 1."""
        with self.lock:
            tag, self._next_tag = self._next_tag, self._next_tag + 1
        return (tag * MAX_PIECES) & ((1 << 64) - 1)

    def progress(self) -> None:
        with self.lock:
            self._worker.progress()


def plausible_address(address: bytes, own: bytes) -> bool:
    """A cheap sanity check of a peer's worker address before UCX unpacks it: UCX aborts the whole
    process on a malformed one. Same header byte (UCX address version and flags) as our own address,
    and a sane length. It catches garbage, not a crafted address: offer UCX to trusted peers only."""
    return 16 <= len(address) <= 1 << 16 and bool(own) and address[:1] == own[:1]


_WORKER: UcxWorker | None = None
_WORKER_LOCK = threading.Lock()
_ABANDONED: list[np.ndarray] = []  # receive buffers of timed-out transfers, kept alive on purpose


def process_worker() -> UcxWorker:
    """The process-wide UCX worker, created on first use."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = UcxWorker()
        return _WORKER


def wait_all(worker: UcxWorker, requests: Sequence[Any], deadline: float, what: str) -> None:
    """Progress `worker` until `requests` complete, or `deadline` (time.monotonic): socket.timeout.

    After a round without completions it sleeps a little (growing to 1 ms): the cores are shared with
    the processes doing the work. Checks every request's status at the end.
    """
    pause = 0.00002
    pending = list(requests)
    while pending:
        worker.progress()
        still = [r for r in pending if not r.completed]
        if not still:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"UCX transfer of {what} did not complete in time")
        if len(still) == len(pending):
            time.sleep(pause)
            pause = min(pause * 2, 0.001)
        else:
            pause = 0.00002
        pending = still
    for r in requests:
        try:
            r.check_error()
        except Exception as exc:
            raise OSError(f"UCX transfer of {what} failed: {exc}") from exc


def send_pieces(endpoint: Any, arrays: Sequence[np.ndarray | None], tag: int, deadline: float) -> None:
    """Send each non-empty array as one tag message `tag + i`; returns once UCX is done with them."""
    worker = process_worker()
    requests = []
    with worker.lock:
        for i, arr in enumerate(arrays):
            if arr is not None and arr.nbytes:
                requests.append(endpoint.tag_send(_Array(arr.view(np.uint8)), tag=_ucx.UCXXTag(tag + i)))
    wait_all(worker, requests, deadline, f"{len(requests)} piece(s)")


def recv_pieces(endpoint: Any, views: Sequence[tuple[int, np.ndarray]], tag: int, deadline: float) -> None:
    """Receive piece `i` into each (i, uint8 view) of `views` (post all, then wait)."""
    worker = process_worker()
    with worker.lock:
        requests = [endpoint.tag_recv(_Array(view), tag=_ucx.UCXXTag(tag + i)) for i, view in views if view.nbytes]
    try:
        wait_all(worker, requests, deadline, f"{len(requests)} piece(s)")
    except BaseException:
        # UCX may still write into these buffers later: never let them be reused.
        _ABANDONED.extend(view for _, view in views)
        raise
