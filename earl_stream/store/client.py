"""The pulling side of the shard data plane: connections, requests, and the choice of transport.

Owns `ShardClient`: one persistent, authenticated connection per peer address, requests for element
ranges of stored arrays, and concurrent pulls from several peers. After authentication each
connection negotiates its `Transport` (`transport.py`: shared memory with a same-host node, UCX
where both ends have it, else TCP) and every pull on it goes through that transport. Turning replies
into arrays is `receive.py`'s. It knows nothing about what keys mean (see `experience.py`, `weights.py`).
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import numpy as np

from earl_stream.errors import ProtocolError, StoreError
from earl_stream.security import encryption
from earl_stream.store import ucx as ucx_transport
from earl_stream.store import wire
from earl_stream.store.conn import PeerConn
from earl_stream.store.frame_mac import AuthedStream, session_key
from earl_stream.store.receive import ALIGN, BufferPool, Piece, SegmentGone
from earl_stream.store.shm import SegmentCache
from earl_stream.store.transport import PullContext, RemoteError, Transport, negotiate, read_reply
from earl_stream.store.wire import ErrorCode, Kind, ManifestEntry

log = logging.getLogger(__name__)

__all__ = ["ALIGN", "Piece", "PeerUnreachable", "RemoteError", "ShardClient", "split_address"]
_T = TypeVar("_T")
# After these errors the server closes the connection (the stream cannot be resynchronised).
_FATAL_CODES = frozenset({ErrorCode.BAD_MAGIC, ErrorCode.UNSUPPORTED_VERSION, ErrorCode.FRAME_TOO_LARGE, ErrorCode.AUTH_FAILED})


class PeerUnreachable(StoreError):
    """The peer could not be reached, dropped the connection, or did not answer in time."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(message)
        self.address = address


def _normalized(pieces: Sequence[Piece]) -> list[Piece]:
    """Pieces as (str, int, int) tuples, checked; numpy integers and the like are converted."""
    out = []
    for piece in pieces:
        key, start, end = piece
        if type(key) is not str or type(start) is not int or type(end) is not int:
            key, start, end = str(key), int(start), int(end)
        if not 0 <= start <= end:
            raise StoreError(f"piece {key!r} [{start}, {end}) is not a valid element range")
        out.append((key, start, end))
    return out


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise StoreError(f"peer address {address!r} is not 'host:port'")
    return host.strip("[]"), int(port)


class ShardClient:
    """Pulls element ranges of arrays from shard nodes. Thread-safe; one connection per peer.

    `secret`: the cluster secret or a worker key, for nodes that require one
    (either gives the data-plane key, `security.keys.plane_key`); `timeout_s`: default bound on one whole
    request (connect, send, and the complete reply); `max_payload`: largest reply accepted, in bytes;
    `shm`: use shared memory with peers on this host (TCP stays the fallback for every other peer);
    `recv_pool_bytes`: idle receive buffers kept for reuse (each is reused once the arrays viewing it
    are gone). `transport`: one of `ucx.TRANSPORTS` ('auto', 'shm', 'tcp', 'ucx'; None: 'auto' when
    `shm`, else 'tcp'); 'ucx' raises StoreError here when `ucxx` does not import, and at connect when
    a peer does not offer UCX. `encrypt` (None: $EARL_STREAM_ENCRYPT): accept only nodes that encrypt their
    frames (security.encrypt); a node that encrypts is followed either way.
    """

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        timeout_s: float = 30.0,
        max_payload: int = wire.DEFAULT_MAX_PAYLOAD_BYTES,
        max_parallel_peers: int = 8,
        shm: bool = True,
        recv_pool_bytes: int = 512 << 20,
        transport: str | None = None,
        encrypt: bool | None = None,
    ) -> None:
        self._settings: dict[str, Any] = {"secret": secret, "timeout_s": timeout_s, "max_payload": max_payload,
                          "max_parallel_peers": max_parallel_peers, "shm": shm, "recv_pool_bytes": recv_pool_bytes,
                          "transport": transport, "encrypt": encrypt}
        self._encrypt = encryption.encrypt_enabled(encrypt)
        if self._encrypt and transport == "ucx":
            raise StoreError("transport 'ucx' was asked for under security.encrypt, but UCX bytes are not encrypted; "
                             "use transport auto, shm or tcp")
        self._transport = ucx_transport.check_transport(transport or ("auto" if shm else "tcp"))
        self._secret = wire.data_key(secret)
        self._maps = SegmentCache() if shm and self._transport in ("auto", "shm") else None
        self._buffers = BufferPool(recv_pool_bytes)
        self._ctx = PullContext(self._buffers, max_payload, self._maps)
        self._timeout_s = timeout_s
        self._max_payload = max_payload
        self._max_parallel = max_parallel_peers
        self._conns: dict[str, PeerConn] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # --- public API ----------------------------------------------------------------------------------

    def pull(
        self,
        address: str,
        pieces: Sequence[Piece],
        *,
        timeout_s: float | None = None,
        zero_copy: bool = False,
        merge_runs: bool = False,
    ) -> list[np.ndarray]:
        """Fetch pieces from one peer in one request; one 1-D array per piece, in order.

        The arrays are views into one receive buffer (each piece aligned to 64 bytes), with the dtype
        the peer stored. With `zero_copy`, pieces a same-host peer holds in shared memory come back
        as read-only views straight into its segment instead (no copy): the peer keeps those bytes
        for as long as any view of them (or of the arrays derived from them) is alive, so hold them
        only as long as needed, and copy before writing. With `merge_runs`, each run of consecutive
        pieces with the same key comes back as one array (the ranges back to back, one copy; never a
        zero-copy view). Raises `RemoteError` (unknown key, bad range), `PeerUnreachable`, or
        `StoreError` on a checksum mismatch.
        """
        pieces = _normalized(pieces)
        if not pieces:
            return []
        what = f"a reply to PULL of {len(pieces)} piece(s)"
        return self._call(address, what, timeout_s, lambda conn, d: self._pull_on(conn, d, address, pieces, zero_copy, merge_runs))

    def sibling(self) -> ShardClient:
        """A new client with this one's settings and connections of its own (a second stream to a peer:
        requests on one connection run one after another). The caller closes it."""
        return ShardClient(**self._settings)

    def transport(self, address: str) -> str | None:
        """'shm', 'ucx' or 'tcp' for a peer this client is connected to, else None."""
        with self._lock:
            conn = self._conns.get(address)
        if conn is None or conn.sock is None or conn.transport is None:
            return None
        return conn.transport.name

    def manifest(self, address: str, prefix: str = "", *, timeout_s: float | None = None) -> list[ManifestEntry]:
        """Keys (sorted), dtypes and shapes of the arrays a peer holds under `prefix`."""
        request = wire.encode_frame(wire.ManifestRequest(prefix))

        def op(conn: PeerConn, deadline: float) -> list[ManifestEntry]:
            assert conn.sock is not None
            conn.sock.sendall(request)
            head, header = self._read_reply(conn.sock, deadline, address, Kind.MANIFEST_REPLY)
            return list(header.entries)

        return self._call(address, f"a MANIFEST reply for prefix {prefix!r}", timeout_s, op)

    def pull_many(
        self,
        requests: Mapping[str, Sequence[Piece]],
        *,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
        zero_copy: bool = False,
        merge_runs: bool = False,
    ) -> dict[str, Any]:
        """Pull from several peers concurrently: address -> list of arrays (as `pull`).

        With `return_exceptions`, a failed peer maps to its StoreError instead of raising the first one.
        """
        results: dict[str, Any] = {}
        kwargs = {"timeout_s": timeout_s, "zero_copy": zero_copy, "merge_runs": merge_runs}
        if len(requests) <= 1:
            for address, pieces in requests.items():
                results[address] = self._guarded(return_exceptions, self.pull, address, pieces, **kwargs)
            return results
        pool = self._get_pool()
        futures = {
            address: pool.submit(functools.partial(self._guarded, return_exceptions, self.pull, address, pieces, **kwargs))
            for address, pieces in requests.items()
        }
        for address, fut in futures.items():
            results[address] = fut.result()
        return results

    def close(self) -> None:
        """Close every connection and the worker pool."""
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
            self._conns.clear()
            pool, self._pool = self._pool, None
        for conn in conns:
            with conn.lock:
                conn.close()
        if pool is not None:
            pool.shutdown(wait=True)
        if self._maps is not None:
            self._maps.close()
        self._buffers.clear()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------------

    @staticmethod
    def _guarded(return_exceptions: bool, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | StoreError:
        try:
            return fn(*args, **kwargs)
        except StoreError as exc:
            if return_exceptions:
                return exc
            raise

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise StoreError("ShardClient is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_parallel, thread_name_prefix="shard-pull")
            return self._pool

    def _conn_for(self, address: str) -> PeerConn:
        with self._lock:
            if self._closed:
                raise StoreError("ShardClient is closed")
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = PeerConn(address)
            return conn

    def call(self, address: str, request: msgspec.Struct, expect: Kind, *, timeout_s: float | None = None) -> Any:
        """Send one request without payload and return the decoded reply header of kind `expect`.

        For request kinds beyond pulls (e.g. the central dispatcher's GATHER); errors as `pull`.
        """
        frame = wire.encode_frame(request)

        def op(conn: PeerConn, deadline: float) -> Any:
            assert conn.sock is not None
            conn.sock.sendall(frame)
            return self._read_reply(conn.sock, deadline, address, expect)[1]

        return self._call(address, f"a {expect.name} reply", timeout_s, op)

    def _call(self, address: str, what: str, timeout_s: float | None, op: Callable[[PeerConn, float], _T]) -> _T:
        """Run `op` on the peer's connection under its lock; reconnect once if a reused one went stale."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        conn = self._conn_for(address)
        with conn.lock:
            for attempt in range(2):
                fresh = conn.sock is None
                if fresh:
                    conn.sock, conn.transport = self._connect(address, deadline, timeout)
                try:
                    conn.flush_released()
                    result = op(conn, deadline)
                    conn.flush_released()  # leases whose arrays died while we held the connection
                    return result
                except TimeoutError:
                    conn.close()
                    raise PeerUnreachable(address, f"timed out after {timeout:g}s waiting for {what} from peer {address}") from None
                except RemoteError as exc:
                    if exc.code in _FATAL_CODES:
                        conn.close()
                    raise
                except OSError as exc:  # includes wire.PeerClosed
                    conn.close()
                    if fresh or attempt:
                        raise PeerUnreachable(address, f"lost connection to peer {address} while waiting for {what}: {exc}") from exc
                    log.info("connection to %s went stale (%s); reconnecting once", address, exc)
                except SegmentGone as exc:
                    conn.close()
                    raise PeerUnreachable(address, f"peer {address} went away while we read its shared memory: {exc}") from exc
                except ProtocolError as exc:
                    conn.close()
                    raise StoreError(f"peer {address} broke the protocol while sending {what}: {exc}") from exc
        raise AssertionError("unreachable")

    def _connect(self, address: str, deadline: float, timeout: float) -> tuple[wire.Stream, Transport]:
        """A connected, authenticated socket and the transport its pulls go through."""
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
        except OSError as exc:
            raise PeerUnreachable(address, f"cannot connect to shard node {address}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = self._handshake(sock, address, deadline)
            transport = negotiate(self._transport, stream, address, deadline, self._ctx)
        except TimeoutError:
            sock.close()
            raise PeerUnreachable(address, f"timed out after {timeout:g}s waiting for the handshake of peer {address}") from None
        except StoreError:
            sock.close()
            raise
        except (OSError, ProtocolError) as exc:
            sock.close()
            raise PeerUnreachable(address, f"handshake with shard node {address} failed: {exc}") from exc
        log.info("pulling from shard node %s over %s", address, transport.name)  # once per connection
        return stream, transport

    def _handshake(self, sock: socket.socket, address: str, deadline: float) -> wire.Stream:
        """Answer the node's challenge; the connection to speak over from then on (frames with MACs
        when the node asked for the secret, `frame_mac`)."""
        _, challenge = self._read_reply(sock, deadline, address, Kind.CHALLENGE)
        if self._encrypt and not challenge.encrypt:
            raise StoreError(f"shard node {address} does not encrypt its frames but this process does (security.encrypt): "
                             "the whole run must use the same setting")
        if not challenge.auth_required:
            return sock
        if self._secret is None:
            raise StoreError(f"shard node {address} requires the cluster secret; pass ShardClient(secret=...)")
        sock.sendall(wire.encode_frame(wire.Hello(wire.auth_mac(self._secret, challenge.nonce))))
        try:
            self._read_reply(sock, deadline, address, Kind.HELLO_OK)
        except RemoteError as exc:
            raise StoreError(f"shard node {address} refused our credentials: is the cluster secret the same?") from exc
        return AuthedStream(sock, session_key(self._secret, challenge.nonce), server=False, encrypt=challenge.encrypt)

    def _read_reply(self, sock: wire.Stream, deadline: float, address: str, expect: Kind) -> tuple[wire.FramePrefix, Any]:
        return read_reply(sock, deadline, address, expect, self._max_payload)

    def _pull_on(
        self, conn: PeerConn, deadline: float, address: str, pieces: list[Piece], zero_copy: bool, merge_runs: bool
    ) -> list[np.ndarray]:
        assert conn.transport is not None
        return conn.transport.pull(conn, deadline, pieces, zero_copy, merge_runs)
