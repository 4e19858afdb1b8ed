"""Turning a PULL / PULL_SHM reply into arrays on the pulling side.

Owns the checks of a reply's piece table against the request, the layout of the receive buffer (one
allocation per reply, each piece aligned to 64 bytes), receiving inline bytes from the socket, copying
shared-memory pieces out of the peer's segments (`SegmentCache`), and the crc32 checks. Connections,
retries and timeouts are `client.py`'s.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Sequence

import numpy as np

from earl_stream.errors import ProtocolError, StoreError
from earl_stream.store import wire
from earl_stream.store.shm import SegmentCache

ALIGN = 64  # every received piece starts at a multiple of this in the receive buffer
Piece = tuple[str, int, int]  # (key, start, end): elements [start, end) of the array under key


class SegmentGone(StoreError):
    """A segment the peer named cannot be opened (the peer exited and removed it)."""


def pieces_of_tcp_reply(reply: wire.PullReply) -> list[wire.ShmPiece]:
    return [wire.ShmPiece(p.dtype, p.count, p.crc32, -1, 0) for p in reply.pieces]


def receive_pieces(
    sock: socket.socket,
    deadline: float,
    address: str,
    pieces: Sequence[Piece],
    infos: Sequence[wire.ShmPiece],
    segments: Sequence[wire.ShmSegment],
    payload_len: int,
    maps: SegmentCache | None,
    max_bytes: int,
) -> tuple[list[np.ndarray], bool]:
    """Arrays of the reply's pieces (views into one fresh buffer), and whether any came from shm.

    Inline pieces are read from `sock` (their bytes follow the header, in order); shm pieces are
    copied out of the peer's segments. Every piece with a crc is checked after it landed.
    """
    if len(infos) != len(pieces):
        raise ProtocolError(f"asked for {len(pieces)} pieces, reply describes {len(infos)}")
    dtypes: dict[str, np.dtype] = {}
    sizes, offsets, total, inline_bytes = [], [], 0, 0
    for (key, start, end), info in zip(pieces, infos):
        dt = dtypes.get(info.dtype)
        if dt is None:
            dt = dtypes[info.dtype] = wire.storable_dtype(info.dtype)
        if info.count != end - start:
            raise ProtocolError(f"piece {key!r}: asked {end - start} elements, reply has {info.count}")
        size = info.count * dt.itemsize
        if info.segment < 0:
            inline_bytes += size
        elif info.segment >= len(segments) or info.offset < 0 or info.offset + size > segments[info.segment].size:
            raise ProtocolError(f"piece {key!r}: shared-memory location {info.segment}:{info.offset}+{size} is invalid")
        sizes.append(size)
        offsets.append(total)
        total = -(-(total + size) // ALIGN) * ALIGN
    if total > max_bytes + ALIGN * len(pieces):
        raise ProtocolError(f"reply of {total} bytes is over this client's max_payload={max_bytes}")
    if inline_bytes != payload_len:
        raise ProtocolError(f"reply payload is {payload_len} bytes, its inline pieces add up to {inline_bytes}")
    buf = np.empty(max(total, 1), dtype=np.uint8)
    _receive_inline(sock, deadline, buf, infos, offsets, sizes)
    used_shm = _copy_shm(address, buf, infos, segments, offsets, sizes, maps)
    out = []
    for (key, start, end), info, off, size in zip(pieces, infos, offsets, sizes):
        raw = buf[off : off + size]
        if info.crc32 >= 0 and zlib.crc32(raw) != info.crc32:
            raise StoreError(
                f"checksum mismatch for {key!r} [{start}, {end}) from peer {address}: the bytes were corrupted "
                "in storage or in transit; treat this shard as lost"
            )
        out.append(raw.view(dtypes[info.dtype]))
    return out, used_shm


def _receive_inline(
    sock: socket.socket, deadline: float, buf: np.ndarray, infos: Sequence[wire.ShmPiece], offsets: list[int], sizes: list[int]
) -> None:
    """Receive runs of inline pieces that are adjacent in the buffer with one recv loop each."""
    view = memoryview(buf)
    run: tuple[int, int] | None = None
    for info, off, size in zip(infos, offsets, sizes):
        if info.segment >= 0 or size == 0:
            continue
        if run is not None and run[1] == off:
            run = (run[0], off + size)
            continue
        if run is not None:
            wire.recv_exact_into(sock, view[run[0] : run[1]], deadline)
        run = (off, off + size)
    if run is not None:
        wire.recv_exact_into(sock, view[run[0] : run[1]], deadline)


def _copy_shm(
    address: str,
    buf: np.ndarray,
    infos: Sequence[wire.ShmPiece],
    segments: Sequence[wire.ShmSegment],
    offsets: list[int],
    sizes: list[int],
    maps: SegmentCache | None,
) -> bool:
    if not segments:
        return False
    if maps is None:
        raise ProtocolError("peer answered with shared-memory locations to a client that did not ask for them")
    try:
        arrays = [maps.get(s.name, s.size) for s in segments]
    except StoreError as exc:  # a bad name or size is a ProtocolError and propagates as such
        raise SegmentGone(f"peer {address}: {exc}") from exc
    for info, off, size in zip(infos, offsets, sizes):
        if info.segment >= 0:
            buf[off : off + size] = arrays[info.segment][info.offset : info.offset + size]
    return True
