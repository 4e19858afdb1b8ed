"""Turning a PULL / PULL_SHM reply into arrays on the pulling side.

Owns the checks of a reply's piece table against the request, the layout of the receive buffer (one
per reply, from a `BufferPool` of recycled buffers; each output array aligned to 64 bytes; a run of
ranges of one key merged into one array lands back to back), receiving inline bytes from the
socket, copying shared-memory pieces out of the peer's segments (`SegmentCache`), and the integrity
checks (crc32 of what crossed the wire, `sum64` of whole arrays read from shared memory). Connections,
retries and timeouts are `client.py`'s.
"""

from __future__ import annotations

import socket
import weakref
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from earl_stream.errors import ProtocolError, StoreError
from earl_stream.store import wire
from earl_stream.store.shm import SegmentCache

ALIGN = 64  # every received piece starts at a multiple of this in the receive buffer
Piece = tuple[str, int, int]  # (key, start, end): elements [start, end) of the array under key


class BufferPool:
    """Receive buffers, recycled once every array viewing one is gone. Thread-safe.

    A recycled buffer is already faulted in: a fresh allocation costs as much again as the copy into
    it. Each reply gets its own base array over a pooled buffer (via a memoryview, so that numpy does
    not collapse views onto the pooled buffer itself); a finalizer on that base returns the buffer.
    At most `max_bytes` of idle buffers are kept.
    """

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self._idle: deque[np.ndarray] = deque()  # appends and pops are atomic: finalizers run anywhere
        self._max = max_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of exactly `nbytes` over a recycled (or new) buffer."""
        chosen, keep = None, []
        while True:
            try:
                backing = self._idle.popleft()
            except IndexError:
                break
            if chosen is None and nbytes <= backing.nbytes <= 2 * nbytes + (1 << 20):
                chosen = backing
            else:
                keep.append(backing)
        self._idle.extend(keep)
        if chosen is None:
            chosen = np.empty(max(-(-nbytes // (1 << 20)) << 20, 1 << 20), dtype=np.uint8)
        base = np.frombuffer(memoryview(chosen), dtype=np.uint8, count=nbytes)
        weakref.finalize(base, self._give_back, chosen).atexit = False
        return base

    def _give_back(self, backing: np.ndarray) -> None:
        if sum(b.nbytes for b in list(self._idle)) + backing.nbytes <= self._max:
            self._idle.append(backing)

    def clear(self) -> None:
        self._idle.clear()


class SegmentGone(StoreError):
    """A segment the peer named cannot be opened (the peer exited and removed it)."""


def pieces_of_tcp_reply(reply: wire.PullReply) -> list[wire.ShmPiece]:
    return [wire.ShmPiece(p.dtype, p.count, p.crc32, -1, 0) for p in reply.pieces]  # all inline: crc32


@dataclass
class Received:
    """A reply's arrays, whether shared memory was used, and, for zero-copy reads, the per-reply base
    arrays over the peer's segments: every returned view keeps its base alive, so a finalizer on the
    bases tells when the caller has dropped the last view (then the node's lease may end)."""

    arrays: list[np.ndarray]
    used_shm: bool
    bases: list[np.ndarray] = field(default_factory=list)


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
    zero_copy: bool = False,
    buffers: BufferPool | None = None,
    merge_runs: bool = False,
) -> Received:
    """The reply's pieces as arrays: views into one receive buffer, or (`zero_copy`) read-only views
    straight into the peer's segments for single pieces that lie there. With `merge_runs`, each run
    of consecutive pieces of one key comes back as one array (its ranges back to back).

    Inline pieces are read from `sock` (their bytes follow the header, in order); shm pieces are
    copied out of (or viewed in) the peer's segments. Every piece with a check is verified.
    """
    if len(infos) != len(pieces):
        raise ProtocolError(f"asked for {len(pieces)} pieces, reply describes {len(infos)}")
    sizes, dts, inline_bytes = _sizes(pieces, infos, segments)
    if inline_bytes != payload_len:
        raise ProtocolError(f"reply payload is {payload_len} bytes, its inline pieces add up to {inline_bytes}")
    runs = _runs(pieces, merge_runs)
    offsets = [-1] * len(pieces)  # -1: read in place (zero copy)
    total = 0
    for first, stop in runs:
        if zero_copy and stop - first == 1 and infos[first].segment >= 0:
            continue
        total = -(-total // ALIGN) * ALIGN
        for i in range(first, stop):
            if dts[i] != dts[first]:
                raise ProtocolError(f"ranges of {pieces[first][0]!r} came back with different dtypes")
            offsets[i] = total
            total += sizes[i]
    if total > max_bytes + ALIGN * len(runs):
        raise ProtocolError(f"reply of {total} bytes is over this client's max_payload={max_bytes}")
    buf = np.empty(max(total, 1), dtype=np.uint8) if buffers is None or total == 0 else buffers.take(total)
    _receive_inline(sock, deadline, buf, infos, offsets, sizes)
    segs = _map_segments(address, segments, maps, fresh=zero_copy)
    raws = []
    for (key, start, end), info, off, size in zip(pieces, infos, offsets, sizes):
        if off >= 0:
            raw = buf[off : off + size]
            if info.segment >= 0:
                raw[:] = segs[info.segment][info.offset : info.offset + size]
        else:
            raw = segs[info.segment][info.offset : info.offset + size]
        if info.check >= 0:
            got = zlib.crc32(raw) if info.segment < 0 else wire.sum64(raw)
            if got != info.check:
                raise StoreError(
                    f"checksum mismatch for {key!r} [{start}, {end}) from peer {address}: the bytes were corrupted "
                    "in storage or in transit; treat this shard as lost"
                )
        raws.append(raw)
    out = []
    for first, stop in runs:
        if stop - first == 1:
            out.append(raws[first].view(dts[first]))
        else:
            out.append(buf[offsets[first] : offsets[stop - 1] + sizes[stop - 1]].view(dts[first]))
    return Received(out, bool(segments), segs if zero_copy else [])


def _sizes(
    pieces: Sequence[Piece], infos: Sequence[wire.ShmPiece], segments: Sequence[wire.ShmSegment]
) -> tuple[list[int], list[np.dtype], int]:
    """Byte size and dtype of every piece, checked against the request and the segments' bounds."""
    known: dict[str, np.dtype] = {}
    sizes, dts, inline_bytes = [], [], 0
    for (key, start, end), info in zip(pieces, infos):
        dt = known.get(info.dtype)
        if dt is None:
            dt = known[info.dtype] = wire.storable_dtype(info.dtype)
        if info.count != end - start:
            raise ProtocolError(f"piece {key!r}: asked {end - start} elements, reply has {info.count}")
        size = info.count * dt.itemsize
        if info.segment < 0:
            inline_bytes += size
        elif info.segment >= len(segments) or info.offset < 0 or info.offset + size > segments[info.segment].size:
            raise ProtocolError(f"piece {key!r}: shared-memory location {info.segment}:{info.offset}+{size} is invalid")
        sizes.append(size)
        dts.append(dt)
    return sizes, dts, inline_bytes


def _runs(pieces: Sequence[Piece], merge: bool) -> list[tuple[int, int]]:
    """[first, stop) index ranges of the output arrays: runs of one key when merging, else single pieces."""
    if not merge:
        return [(i, i + 1) for i in range(len(pieces))]
    runs: list[tuple[int, int]] = []
    for i, piece in enumerate(pieces):
        if runs and pieces[runs[-1][0]][0] == piece[0]:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


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


def _map_segments(address: str, segments: Sequence[wire.ShmSegment], maps: SegmentCache | None, *, fresh: bool) -> list[np.ndarray]:
    """uint8 arrays over the reply's segments (`fresh`: new base arrays of this reply's own)."""
    if not segments:
        return []
    if maps is None:
        raise ProtocolError("peer answered with shared-memory locations to a client that did not ask for them")
    try:
        return [maps.get(s.name, s.size, fresh=fresh) for s in segments]
    except StoreError as exc:  # a bad name or size is a ProtocolError and propagates as such
        raise SegmentGone(f"peer {address}: {exc}") from exc
