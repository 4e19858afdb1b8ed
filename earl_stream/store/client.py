"""The pulling side of the shard data plane: connections, requests, and the choice of transport.

Owns `ShardClient`: one persistent, authenticated connection per peer address, requests for element
ranges of stored arrays, concurrent pulls from several peers, and, per peer, the transport: after
authentication it asks the node for a shared-memory offer and, if this process can read the node's
probe file (same host, same /dev/shm), pulls with PULL_SHM (the reply says where the bytes lie and
the client copies them out of the mapped segment); otherwise, when `ucxx` is installed and the
node offers it, PULL_UCX (the piece table over the socket, the bytes over UCX, `ucx.py`); otherwise,
or with `shm=False` / `transport='tcp'`, plain PULL over TCP. Turning replies into arrays is
`receive.py`'s. It knows nothing about what keys mean (see `experience.py`, `weights.py`).
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import numpy as np

from earl_stream.errors import ProtocolError, StoreError
from earl_stream.store import ucx as ucx_transport
from earl_stream.store import wire
from earl_stream.store.conn import LeaseToken, PeerConn
from earl_stream.store.receive import ALIGN, BufferPool, Piece, SegmentGone, pieces_of_tcp_reply, receive_pieces
from earl_stream.store.shm import SegmentCache, read_probe
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


class RemoteError(StoreError):
    """The peer answered with an ERROR frame."""

    def __init__(self, address: str, code: ErrorCode, message: str) -> None:
        super().__init__(f"peer {address} refused: {code.name}: {message}")
        self.address = address
        self.code = code


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

    `secret`: cluster secret for nodes that require one; `timeout_s`: default bound on one whole
    request (connect, send, and the complete reply); `max_payload`: largest reply accepted, in bytes;
    `shm`: use shared memory with peers on this host (TCP stays the fallback for every other peer);
    `recv_pool_bytes`: idle receive buffers kept for reuse (each is reused once the arrays viewing it
    are gone). `transport`: one of `ucx.TRANSPORTS` ('auto', 'shm', 'tcp', 'ucx'; None: 'auto' when
    `shm`, else 'tcp'); 'ucx' raises StoreError here when `ucxx` does not import, and at connect when
    a peer does not offer UCX.
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
    ) -> None:
        self._transport = ucx_transport.check_transport(transport or ("auto" if shm else "tcp"))
        self._secret = secret
        self._maps = SegmentCache() if shm and self._transport in ("auto", "shm") else None
        self._buffers = BufferPool(recv_pool_bytes)
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

    def transport(self, address: str) -> str | None:
        """'shm', 'ucx' or 'tcp' for a peer this client is connected to, else None."""
        with self._lock:
            conn = self._conns.get(address)
        if conn is None or conn.sock is None:
            return None
        return "shm" if conn.shm else "ucx" if conn.ucx_endpoint is not None else "tcp"

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
                    conn.sock, conn.shm, conn.ucx_endpoint = self._connect(address, deadline, timeout)
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

    def _connect(self, address: str, deadline: float, timeout: float) -> tuple[socket.socket, bool, object | None]:
        """A connected, authenticated socket, whether pulls from this peer go through shared memory, and
        else the UCX endpoint its bytes come through (None: over the socket)."""
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
        except OSError as exc:
            raise PeerUnreachable(address, f"cannot connect to shard node {address}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._handshake(sock, address, deadline)
            shm = self._maps is not None and self._negotiate_shm(sock, address, deadline)
            endpoint = None if shm else self._negotiate_ucx(sock, address, deadline)
        except TimeoutError:
            sock.close()
            raise PeerUnreachable(address, f"timed out after {timeout:g}s waiting for the handshake of peer {address}") from None
        except StoreError:
            sock.close()
            raise
        except (OSError, ProtocolError) as exc:
            sock.close()
            raise PeerUnreachable(address, f"handshake with shard node {address} failed: {exc}") from exc
        log.debug("connected to shard node %s over %s", address, "shm" if shm else "UCX" if endpoint is not None else "TCP")
        return sock, shm, endpoint

    def _negotiate_ucx(self, sock: socket.socket, address: str, deadline: float) -> object | None:
        """Exchange UCX worker addresses with the node; its endpoint, or None (TCP) unless 'ucx' is required."""
        if self._transport not in ("auto", "ucx") or not ucx_transport.ucx_available():
            return None
        try:
            worker = ucx_transport.process_worker()
        except StoreError as exc:
            if self._transport == "ucx":
                raise
            log.warning("UCX is installed but unusable here (%s); pulling from %s over TCP", exc, address)
            return None
        sock.sendall(wire.encode_frame(wire.UcxHello(worker.address)))
        try:
            _, offer = self._read_reply(sock, deadline, address, Kind.UCX_OFFER_REPLY)
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_KIND or self._transport == "ucx":
                raise
            return None  # a node without the UCX transport
        if offer.available:
            return worker.endpoint(offer.worker_address)
        if self._transport == "ucx":
            raise StoreError(f"transport 'ucx' was asked for but shard node {address} does not offer it: {offer.reason}")
        return None

    def _negotiate_shm(self, sock: socket.socket, address: str, deadline: float) -> bool:
        """Ask for the node's shared-memory offer; accept it only if we can read its probe here."""
        sock.sendall(wire.encode_frame(wire.ShmOfferRequest()))
        try:
            _, offer = self._read_reply(sock, deadline, address, Kind.SHM_OFFER_REPLY)
        except RemoteError as exc:
            if exc.code == ErrorCode.UNKNOWN_KIND:
                return False  # a node without the shared-memory transport
            raise
        return bool(offer.available) and read_probe(offer.probe, offer.token)

    def _handshake(self, sock: socket.socket, address: str, deadline: float) -> None:
        _, challenge = self._read_reply(sock, deadline, address, Kind.CHALLENGE)
        if not challenge.auth_required:
            return
        if self._secret is None:
            raise StoreError(f"shard node {address} requires the cluster secret; pass ShardClient(secret=...)")
        sock.sendall(wire.encode_frame(wire.Hello(wire.auth_mac(self._secret, challenge.nonce))))
        try:
            self._read_reply(sock, deadline, address, Kind.HELLO_OK)
        except RemoteError as exc:
            raise StoreError(f"shard node {address} refused our credentials: is the cluster secret the same?") from exc

    def _read_reply(self, sock: socket.socket, deadline: float, address: str, expect: Kind) -> tuple[wire.FramePrefix, Any]:
        """Read one frame's prefix and header; an ERROR frame raises `RemoteError`."""
        prefix = wire.recv_exact(sock, wire.PREFIX_SIZE, deadline)
        head = wire.parse_prefix(prefix, self._max_payload)
        header = wire.decode_header(head.kind, wire.recv_exact(sock, head.header_len, deadline))
        if head.kind == Kind.ERROR:
            if head.payload_len:
                raise ProtocolError(f"ERROR frame with a {head.payload_len}-byte payload")
            raise RemoteError(address, header.code, header.message)
        if head.kind != expect:
            raise ProtocolError(f"expected {expect.name}, got {Kind(head.kind).name}")
        if expect not in (Kind.PULL_REPLY, Kind.PULL_SHM_REPLY) and head.payload_len:
            raise ProtocolError(f"{expect.name} frame with an unexpected {head.payload_len}-byte payload")
        return head, header

    def _pull_on(
        self, conn: PeerConn, deadline: float, address: str, pieces: list[Piece], zero_copy: bool, merge_runs: bool
    ) -> list[np.ndarray]:
        sock = conn.sock
        assert sock is not None
        if conn.ucx_endpoint is not None:
            return self._pull_ucx(conn, deadline, address, pieces, merge_runs)
        if not conn.shm:
            sock.sendall(wire.encode_frame(wire.PullRequest(pieces)))
            head, reply = self._read_reply(sock, deadline, address, Kind.PULL_REPLY)
            infos, segments, lease = pieces_of_tcp_reply(reply), [], 0
        else:
            sock.sendall(wire.encode_frame(wire.PullShmRequest(pieces, hold=zero_copy)))
            head, reply = self._read_reply(sock, deadline, address, Kind.PULL_SHM_REPLY)
            infos, segments, lease = reply.pieces, reply.segments, reply.lease
            if zero_copy and segments and not lease:
                raise ProtocolError("zero-copy reply without a held lease")
        got = receive_pieces(
            sock, deadline, address, pieces, infos, segments, head.payload_len, self._maps, self._max_payload, zero_copy,
            self._buffers, merge_runs,
        )
        if got.bases:
            # The node keeps the regions until the last view of this reply is gone.
            token = LeaseToken(conn, conn.generation, lease, len(got.bases))
            for base in got.bases:
                weakref.finalize(base, token.drop).atexit = False
        elif got.used_shm:
            # Lets the node reuse the regions now rather than at our next request; nothing to wait for.
            sock.sendall(wire.encode_frame(wire.ShmDone()))
        return got.arrays

    def _pull_ucx(self, conn: PeerConn, deadline: float, address: str, pieces: list[Piece], merge_runs: bool) -> list[np.ndarray]:
        """PULL_UCX: the piece table comes over the socket, the bytes over UCX into one receive buffer."""
        sock, endpoint = conn.sock, conn.ucx_endpoint
        assert sock is not None and endpoint is not None
        if len(pieces) > ucx_transport.MAX_PIECES:
            raise StoreError(f"{len(pieces)} pieces in one pull; at most {ucx_transport.MAX_PIECES} over UCX")
        tag = ucx_transport.process_worker().new_tag()
        sock.sendall(wire.encode_frame(wire.PullUcxRequest(pieces, tag)))
        _, reply = self._read_reply(sock, deadline, address, Kind.PULL_UCX_REPLY)

        def receive(views: list[tuple[int, np.ndarray]]) -> None:
            ucx_transport.recv_pieces(endpoint, views, tag, deadline)

        got = receive_pieces(
            sock, deadline, address, pieces, pieces_of_tcp_reply(reply), [], reply.nbytes, None, self._max_payload, False,
            self._buffers, merge_runs, ucx_receive=receive,
        )
        return got.arrays
