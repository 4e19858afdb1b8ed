"""How the bytes of one peer's pulls travel, once its connection is authenticated: one `Transport` each.

Every connection of a `ShardClient` speaks its requests and replies over the authenticated socket
(`wire.Stream`); a transport decides where a pull's bytes come from:
- `TcpTransport`: inline on the socket, after the reply header (PULL);
- `ShmTransport`: the reply says where the bytes lie in the node's /dev/shm segments and the client
  copies them out, or views them in place for a zero-copy pull under a held lease (PULL_SHM); only
  with a peer on this host (the client must read the node's probe file);
- `UcxTransport`: the piece table on the socket, the bytes over UCX into the receive buffer (PULL_UCX).
`negotiate` asks the peer, in the order the client's `transport` setting allows ('auto': shm, then
UCX, then TCP), and returns the first transport it offers. Every transport verifies the same
checksums (`receive.py`) and raises the client's errors; `tests/store/test_transport_contract.py`
runs one contract over all of them. The serving side is the node's (`node.py`).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from earl_stream.errors import ProtocolError, StoreError
from earl_stream.store import ucx as ucx_transport
from earl_stream.store import wire
from earl_stream.store.conn import LeaseToken, PeerConn, Transport
from earl_stream.store.receive import BufferPool, Piece, pieces_of_tcp_reply, receive_pieces
from earl_stream.store.shm import SegmentCache, read_probe
from earl_stream.store.wire import ErrorCode, Kind

log = logging.getLogger(__name__)


class RemoteError(StoreError):
    """The peer answered with an ERROR frame."""

    def __init__(self, address: str, code: ErrorCode, message: str) -> None:
        super().__init__(f"peer {address} refused: {code.name}: {message}")
        self.address = address
        self.code = code


def read_reply(sock: wire.Stream, deadline: float, address: str, expect: Kind, max_payload: int) -> tuple[wire.FramePrefix, Any]:
    """Read one frame's prefix and header; an ERROR frame raises `RemoteError`."""
    prefix = wire.recv_exact(sock, wire.PREFIX_SIZE, deadline)
    head = wire.parse_prefix(prefix, max_payload)
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


@dataclass(frozen=True)
class PullContext:
    """What every transport of one client shares: where replies land and how large they may be."""

    buffers: BufferPool
    max_payload: int
    maps: SegmentCache | None  # None: this client does not use shared memory


class TcpTransport:
    """PULL: the bytes follow the reply header on the socket."""

    name: ClassVar[str] = "tcp"

    def __init__(self, address: str, ctx: PullContext) -> None:
        self.address, self.ctx = address, ctx

    def pull(self, conn: PeerConn, deadline: float, pieces: list[Piece], zero_copy: bool, merge_runs: bool) -> list[np.ndarray]:
        sock = _sock(conn)
        sock.sendall(wire.encode_frame(wire.PullRequest(pieces)))
        head, reply = read_reply(sock, deadline, self.address, Kind.PULL_REPLY, self.ctx.max_payload)
        got = receive_pieces(sock, deadline, self.address, pieces, pieces_of_tcp_reply(reply), [], head.payload_len, None,
                             self.ctx.max_payload, False, self.ctx.buffers, merge_runs)
        return got.arrays


class ShmTransport:
    """PULL_SHM: the node names the segment regions that hold the bytes; small or unpooled pieces
    still come inline. A zero-copy pull holds a lease the node keeps until the arrays are gone."""

    name: ClassVar[str] = "shm"

    def __init__(self, address: str, ctx: PullContext) -> None:
        self.address, self.ctx = address, ctx

    @classmethod
    def offered(cls, sock: wire.Stream, address: str, deadline: float, ctx: PullContext) -> ShmTransport | None:
        """The transport if the node offers shared memory and this process can read its probe here."""
        if ctx.maps is None:
            return None
        sock.sendall(wire.encode_frame(wire.ShmOfferRequest()))
        try:
            _, offer = read_reply(sock, deadline, address, Kind.SHM_OFFER_REPLY, ctx.max_payload)
        except RemoteError as exc:
            if exc.code == ErrorCode.UNKNOWN_KIND:
                return None  # a node without the shared-memory transport
            raise
        return cls(address, ctx) if offer.available and read_probe(offer.probe, offer.token) else None

    def pull(self, conn: PeerConn, deadline: float, pieces: list[Piece], zero_copy: bool, merge_runs: bool) -> list[np.ndarray]:
        sock = _sock(conn)
        sock.sendall(wire.encode_frame(wire.PullShmRequest(pieces, hold=zero_copy)))
        head, reply = read_reply(sock, deadline, self.address, Kind.PULL_SHM_REPLY, self.ctx.max_payload)
        if zero_copy and reply.segments and not reply.lease:
            raise ProtocolError("zero-copy reply without a held lease")
        got = receive_pieces(sock, deadline, self.address, pieces, reply.pieces, reply.segments, head.payload_len, self.ctx.maps,
                             self.ctx.max_payload, zero_copy, self.ctx.buffers, merge_runs)
        if got.bases:
            # The node keeps the regions until the last view of this reply is gone.
            token = LeaseToken(conn, conn.generation, reply.lease, len(got.bases))
            for base in got.bases:
                weakref.finalize(base, token.drop).atexit = False
        elif got.used_shm:
            # Lets the node reuse the regions now rather than at our next request; nothing to wait for.
            sock.sendall(wire.encode_frame(wire.ShmDone()))
        return got.arrays


class UcxTransport:
    """PULL_UCX: the piece table over the socket, the bytes over UCX (`ucx.py`) into one receive buffer."""

    name: ClassVar[str] = "ucx"

    def __init__(self, address: str, ctx: PullContext, endpoint: Any) -> None:
        self.address, self.ctx, self.endpoint = address, ctx, endpoint

    @classmethod
    def offered(cls, sock: wire.Stream, address: str, deadline: float, ctx: PullContext, required: bool) -> UcxTransport | None:
        """Exchange UCX worker addresses with the node: the transport, or None (TCP) unless `required`,
        when a node or a process without UCX raises StoreError saying why."""
        if not ucx_transport.ucx_available():
            return None
        try:
            worker = ucx_transport.process_worker()
        except StoreError as exc:
            if required:
                raise
            log.warning("UCX is installed but unusable here (%s); pulling from %s over TCP", exc, address)
            return None
        sock.sendall(wire.encode_frame(wire.UcxHello(worker.address)))
        try:
            _, offer = read_reply(sock, deadline, address, Kind.UCX_OFFER_REPLY, ctx.max_payload)
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_KIND or required:
                raise
            return None  # a node without the UCX transport
        if offer.available:
            return cls(address, ctx, worker.endpoint(offer.worker_address))
        if required:
            raise StoreError(f"transport 'ucx' was asked for but shard node {address} does not offer it: {offer.reason}")
        return None

    def pull(self, conn: PeerConn, deadline: float, pieces: list[Piece], zero_copy: bool, merge_runs: bool) -> list[np.ndarray]:
        sock = _sock(conn)
        if len(pieces) > ucx_transport.MAX_PIECES:
            raise StoreError(f"{len(pieces)} pieces in one pull; at most {ucx_transport.MAX_PIECES} over UCX")
        tag = ucx_transport.process_worker().new_tag()
        sock.sendall(wire.encode_frame(wire.PullUcxRequest(pieces, tag)))
        _, reply = read_reply(sock, deadline, self.address, Kind.PULL_UCX_REPLY, self.ctx.max_payload)

        def receive(views: list[tuple[int, np.ndarray]]) -> None:
            ucx_transport.recv_pieces(self.endpoint, views, tag, deadline)

        got = receive_pieces(sock, deadline, self.address, pieces, pieces_of_tcp_reply(reply), [], reply.nbytes, None,
                             self.ctx.max_payload, False, self.ctx.buffers, merge_runs, ucx_receive=receive)
        return got.arrays


def negotiate(choice: str, sock: wire.Stream, address: str, deadline: float, ctx: PullContext) -> Transport:
    """The transport for a fresh, authenticated connection: `choice` is the client's setting ('auto':
    shm with a same-host peer, else UCX where both ends have it, else TCP; 'shm': shm else TCP; 'ucx':
    UCX or a StoreError; 'tcp': TCP)."""
    if choice in ("auto", "shm"):
        shm = ShmTransport.offered(sock, address, deadline, ctx)
        if shm is not None:
            return shm
    if choice in ("auto", "ucx"):
        ucx = UcxTransport.offered(sock, address, deadline, ctx, required=choice == "ucx")
        if ucx is not None:
            return ucx
    return TcpTransport(address, ctx)


def _sock(conn: PeerConn) -> wire.Stream:
    assert conn.sock is not None, "a transport pulls only on a connected PeerConn"
    return conn.sock
