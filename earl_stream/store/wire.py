"""Framing of the shard data plane: frame layout, typed headers, limits, and auth proofs.

A frame is a fixed prefix `struct` (magic b"ESTR", protocol version u16, kind u16, header length u32,
payload length u64), then a msgpack header (a msgspec struct chosen by kind), then raw payload bytes.
Nothing here is ever unpickled. This module owns the byte layout and its validation; the last section
holds the few stream primitives (exact receive into a buffer, vectored send) that the TCP transport
of `node.py` and `client.py` share. Storage and connection handling live in those modules.

Conversation: on connect the server sends CHALLENGE (nonce, auth_required). If auth is required, the
client's first frame must be HELLO with HMAC-SHA256(secret, context || nonce); the server answers
HELLO_OK, or ERROR and closes. Then any number of PULL / MANIFEST requests, each answered by one reply
(PULL_REPLY / MANIFEST_REPLY) or by ERROR. After HELLO_OK every frame, both ways, is followed by a
16-byte Poly1305 tag under a key of that connection and a per-direction sequence number
(`frame_mac.AuthedStream`): frames are authenticated, not only checksummed.

Same-host peers (only after authentication): SHM_OFFER is answered by SHM_OFFER_REPLY naming a probe
file under /dev/shm and a random token; a client that can read the token there sees this node's
segments and sends PULL_SHM instead of PULL. Its reply says, per piece, where the bytes lie (segment,
byte offset: chosen by the server, never by the client) or carries them inline in the payload. The
regions of a PULL_SHM reply stay leased to the connection until the client sends SHM_DONE (one-way,
never answered), sends its next request, or disconnects; only then may the node reuse them. A
PULL_SHM with `hold` gets a numbered lease instead, which lasts until an SHM_DONE lists its number
or the connection closes (zero-copy reads whose lifetime the client decides).
UCX (when `ucxx` is installed on both sides; `ucx.py`): UCX_HELLO carries the client's UCX worker
address, UCX_OFFER_REPLY the node's (addresses travel over this authenticated connection, never a
UCX listener, so that UCX may pick shared memory or RDMA). A PULL_UCX is answered by a PULL_UCX_REPLY
header on this socket (dtype, count and crc32 per piece, as PULL_REPLY) while the bytes of piece i
travel as one UCX tag message tagged `tag + i`.
GATHER / DROP are served only by a central dispatcher node (`central.py`); other nodes answer
UNKNOWN_KIND.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np

from earl_stream.errors import ProtocolError
from earl_stream.security.keys import Plane, plane_key

MAGIC = b"ESTR"
PROTOCOL_VERSION = 1
PREFIX = struct.Struct("!4sHHIQ")  # magic, version, kind, header length, payload length
PREFIX_SIZE = PREFIX.size
MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
NONCE_BYTES = 32
_AUTH_CONTEXT = b"earl_stream shard node auth v1\x00"
# Storable element types: fixed-size numbers only (no objects, no structured records).
STORABLE_KINDS = frozenset("biufc")


class Kind(enum.IntEnum):
    """Frame kinds."""

    CHALLENGE = 1  # server -> client, first frame of every connection
    HELLO = 2  # client -> server, auth proof
    HELLO_OK = 3
    PULL = 10
    PULL_REPLY = 11
    MANIFEST = 12
    MANIFEST_REPLY = 13
    ERROR = 15
    SHM_OFFER = 20
    SHM_OFFER_REPLY = 21
    PULL_SHM = 22
    PULL_SHM_REPLY = 23
    SHM_DONE = 24  # one-way: never answered
    UCX_HELLO = 25
    UCX_OFFER_REPLY = 26
    PULL_UCX = 27
    PULL_UCX_REPLY = 28
    GATHER = 30
    GATHER_REPLY = 31
    DROP = 32
    DROP_REPLY = 33


class ErrorCode(enum.IntEnum):
    """Why a request was refused (carried in ERROR frames)."""

    BAD_MAGIC = 1
    UNSUPPORTED_VERSION = 2
    FRAME_TOO_LARGE = 3
    MALFORMED = 4
    UNKNOWN_KIND = 5
    AUTH_FAILED = 6
    UNKNOWN_KEY = 7
    BAD_RANGE = 8
    REPLY_TOO_LARGE = 9
    INTERNAL = 10
    CORRUPT = 11  # the node's own copy failed its check: treat the shard as lost


class Challenge(msgspec.Struct, frozen=True):
    nonce: bytes
    auth_required: bool
    encrypt: bool = False  # frames after HELLO_OK are encrypted (security.encrypt; store/frame_mac.py)


class Hello(msgspec.Struct, frozen=True):
    mac: bytes


class HelloOk(msgspec.Struct, frozen=True):
    pass


class PullRequest(msgspec.Struct, frozen=True):
    """Pieces as (key, start, end): elements [start, end) of the 1-D array stored under key."""

    pieces: list[tuple[str, int, int]]


class PieceInfo(msgspec.Struct, frozen=True, array_like=True):
    """One piece of a PULL reply: numpy dtype string (e.g. '<i4'), element count, crc32 of its bytes."""

    dtype: str
    count: int
    crc32: int


class PullReply(msgspec.Struct, frozen=True):
    """Payload = the pieces' bytes back to back, in request order."""

    pieces: list[PieceInfo]


class ManifestRequest(msgspec.Struct, frozen=True):
    prefix: str


class ManifestEntry(msgspec.Struct, frozen=True):
    """One stored array: its key, numpy dtype string and shape (always 1-D today)."""

    key: str
    dtype: str
    shape: list[int]


class ManifestReply(msgspec.Struct, frozen=True):
    entries: list[ManifestEntry]


class ErrorReply(msgspec.Struct, frozen=True):
    code: ErrorCode
    message: str


class ShmOfferRequest(msgspec.Struct, frozen=True):
    pass


class ShmOffer(msgspec.Struct, frozen=True):
    """`available`: the node keeps shards in shared memory; `probe`: file under /dev/shm holding `token`."""

    available: bool
    probe: str
    token: bytes


class PullShmRequest(msgspec.Struct, frozen=True):
    """Same pieces as `PullRequest`; the reply may point into shared memory instead of carrying bytes.

    `hold`: the client reads the regions in place for as long as it likes; the reply names a lease
    that the client ends with SHM_DONE(leases=[id]) (or by disconnecting)."""

    pieces: list[tuple[str, int, int]]
    hold: bool = False


class ShmSegment(msgspec.Struct, frozen=True, array_like=True):
    name: str
    size: int


class ShmPiece(msgspec.Struct, frozen=True, array_like=True):
    """dtype string, element count, integrity check, segment index into the reply's `segments` (-1:
    inline in the payload), byte offset in it. `check` is the crc32 of an inline piece's bytes, or the
    `sum64` taken at put of a whole array in shared memory, or, for a sub-range in shared memory, the
    put-time `sum64` of the check blocks covering it: the `check_bytes` bytes at `check_offset` of the
    same segment (the reader sums them where they lie; -1: no check)."""

    dtype: str
    count: int
    check: int
    segment: int
    offset: int
    check_offset: int = 0
    check_bytes: int = 0  # 0: `check` covers exactly the piece's own bytes


class PullShmReply(msgspec.Struct, frozen=True):
    """Payload = the inline pieces' bytes back to back, in request order."""

    segments: list[ShmSegment]
    pieces: list[ShmPiece]
    lease: int = 0  # id of a held lease (0: none; the regions are leased until the next frame)


class ShmDone(msgspec.Struct, frozen=True):
    """Ends the implicit lease of the last reply, and the held leases listed."""

    leases: list[int] = []


class UcxHello(msgspec.Struct, frozen=True):
    """The client's UCX worker address (opaque bytes from ucxx)."""

    worker_address: bytes


class UcxOffer(msgspec.Struct, frozen=True):
    """`available`: the node serves PULL_UCX; `worker_address`: its UCX worker's address."""

    available: bool
    worker_address: bytes
    reason: str = ""  # why not, when not available


class PullUcxRequest(msgspec.Struct, frozen=True):
    """Same pieces as `PullRequest`; `tag`: the UCX tag of piece 0 (piece i travels as `tag + i`)."""

    pieces: list[tuple[str, int, int]]
    tag: int


class PullUcxReply(msgspec.Struct, frozen=True):
    """Per piece dtype, count and crc32 (as `PullReply`); `nbytes`: bytes that follow over UCX."""

    pieces: list[PieceInfo]
    nbytes: int


class GatherRequest(msgspec.Struct, frozen=True):
    """Central mode: fetch these pieces (whole arrays) of step `step` from their producers and keep them."""

    step: int
    sources: list[tuple[str, list[tuple[str, int, int]]]]


class GatherReply(msgspec.Struct, frozen=True):
    """`stored`: arrays now held for the step; `missing`: requested keys that could not be fetched."""

    stored: int
    missing: list[str]


class DropRequest(msgspec.Struct, frozen=True):
    prefix: str


class DropReply(msgspec.Struct, frozen=True):
    freed: int


HEADER_TYPES: dict[Kind, type[msgspec.Struct]] = {
    Kind.CHALLENGE: Challenge,
    Kind.HELLO: Hello,
    Kind.HELLO_OK: HelloOk,
    Kind.PULL: PullRequest,
    Kind.PULL_REPLY: PullReply,
    Kind.MANIFEST: ManifestRequest,
    Kind.MANIFEST_REPLY: ManifestReply,
    Kind.ERROR: ErrorReply,
    Kind.SHM_OFFER: ShmOfferRequest,
    Kind.SHM_OFFER_REPLY: ShmOffer,
    Kind.PULL_SHM: PullShmRequest,
    Kind.PULL_SHM_REPLY: PullShmReply,
    Kind.SHM_DONE: ShmDone,
    Kind.UCX_HELLO: UcxHello,
    Kind.UCX_OFFER_REPLY: UcxOffer,
    Kind.PULL_UCX: PullUcxRequest,
    Kind.PULL_UCX_REPLY: PullUcxReply,
    Kind.GATHER: GatherRequest,
    Kind.GATHER_REPLY: GatherReply,
    Kind.DROP: DropRequest,
    Kind.DROP_REPLY: DropReply,
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(typ) for kind, typ in HEADER_TYPES.items()}
_KIND_OF = {typ: kind for kind, typ in HEADER_TYPES.items()}


class FrameError(ProtocolError):
    """A frame broke the protocol. `fatal` means the byte stream cannot be resynchronised."""

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool) -> None:
        super().__init__(message)
        self.code = code
        self.fatal = fatal


class PeerClosed(ConnectionError):
    """The peer closed the connection (EOF)."""


@dataclass(frozen=True)
class FramePrefix:
    kind: int
    header_len: int
    payload_len: int


def encode_frame(header: msgspec.Struct, payload_len: int = 0) -> bytes:
    """Prefix + msgpack header of one frame; the caller sends `payload_len` payload bytes after it."""
    kind = _KIND_OF[type(header)]
    raw = _ENCODER.encode(header)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{kind.name} header is {len(raw)} bytes, over the {MAX_HEADER_BYTES}-byte limit; split the request")
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, kind, len(raw), payload_len) + raw


def parse_prefix(raw: bytes | bytearray | memoryview, max_payload: int) -> FramePrefix:
    """Validate a fixed prefix; every failure here is fatal (the stream cannot be trusted after it)."""
    magic, version, kind, header_len, payload_len = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise FrameError(ErrorCode.BAD_MAGIC, f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", fatal=True)
    if version != PROTOCOL_VERSION:
        raise FrameError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} not supported (this node speaks {PROTOCOL_VERSION})",
            fatal=True,
        )
    if header_len > MAX_HEADER_BYTES:
        raise FrameError(ErrorCode.FRAME_TOO_LARGE, f"header length {header_len} > limit {MAX_HEADER_BYTES}", fatal=True)
    if payload_len > max_payload:
        raise FrameError(ErrorCode.FRAME_TOO_LARGE, f"payload length {payload_len} > limit {max_payload}", fatal=True)
    return FramePrefix(kind, header_len, payload_len)


def decode_header(kind: int, raw: bytes | bytearray | memoryview) -> Any:
    """Decode the msgpack header of a frame of `kind` (errors are not fatal: the frame was fully read)."""
    try:
        decoder = _DECODERS[Kind(kind)]
    except ValueError:
        raise FrameError(ErrorCode.UNKNOWN_KIND, f"unknown frame kind {kind}", fatal=False) from None
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(ErrorCode.MALFORMED, f"malformed {Kind(kind).name} header: {exc}", fatal=False) from exc


def data_key(credential: bytes | None) -> bytes | None:
    """The data-plane key a node or client proves, from the cluster secret or a worker key (the same from both:
    `security.keys.plane_key`); None: an open plane."""
    return None if credential is None else plane_key(credential, Plane.DATA)


def auth_mac(secret: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 proof that the sender holds `secret`, bound to this connection's nonce."""
    return hmac.new(secret, _AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def check_mac(secret: bytes, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(auth_mac(secret, nonce), mac)


_MASK64 = (1 << 64) - 1


_U64 = np.dtype("<u8")


def word_sum(raw: np.ndarray) -> int:
    """`sum64` without the length term: little-endian u64 words (tail zero-padded) summed mod 2**64."""
    n = raw.shape[0]
    whole = n - n % 8
    total = int(np.add.reduce(raw[:whole].view(_U64), dtype=np.uint64)) if whole else 0
    if whole != n:
        total += int.from_bytes(raw[whole:].tobytes(), "little")
    return total & _MASK64


def sum64(raw: np.ndarray) -> int:
    """Fast 64-bit check of a uint8 array: its little-endian u64 words (tail zero-padded) summed mod
    2**64, plus its length. Any single corrupted word changes it. Used where there is no wire to
    protect (shared memory); crc32 guards the wire."""
    return (word_sum(raw) + raw.shape[0]) & _MASK64


def storable_dtype(text: str) -> np.dtype:
    """Parse a dtype string from the wire, accepting only fixed-size numeric types."""
    try:
        dtype = np.dtype(text)
    except TypeError as exc:
        raise ProtocolError(f"unknown dtype {text!r} on the wire") from exc
    if dtype.kind not in STORABLE_KINDS or dtype.hasobject or dtype.itemsize == 0:
        raise ProtocolError(f"dtype {text!r} is not a storable numeric type")
    return dtype


# --- stream primitives shared by the TCP transport (node and client) --------------------------------

_IOV_MAX = 1024


class Stream(Protocol):
    """A connection the shard node and client speak frames over: a socket, or a socket whose frames
    carry MACs after the handshake (`frame_mac.AuthedStream`)."""

    def recv_into(self, view: memoryview | bytearray, nbytes: int = ..., /) -> int: ...
    def sendall(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def sendmsg(self, buffers: Sequence[bytes | bytearray | memoryview], /) -> int: ...
    def settimeout(self, value: float | None, /) -> None: ...
    def setblocking(self, flag: bool, /) -> None: ...
    def shutdown(self, how: int, /) -> None: ...
    def close(self) -> None: ...


def recv_exact_into(sock: Stream, view: memoryview, deadline: float | None) -> None:
    """Fill `view` from `sock`; `deadline` (time.monotonic) bounds the whole read (socket.timeout)."""
    got, size = 0, len(view)
    while got < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerClosed(f"peer closed the connection after {got} of {size} bytes")
        got += n


def recv_exact(sock: Stream, size: int, deadline: float | None) -> bytearray:
    buf = bytearray(size)
    recv_exact_into(sock, memoryview(buf), deadline)
    return buf


def send_buffers(sock: Stream, buffers: Sequence[bytes | memoryview]) -> None:
    """Send buffers back to back with vectored `sendmsg`, no joining copies; handles partial sends."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX])
        while sent > 0:
            head = len(views[i])
            if sent >= head:
                sent -= head
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
