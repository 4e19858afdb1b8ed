"""Turning a PULL / PULL_SHM reply into arrays on the pulling side.

Owns the checks of a reply's piece table against the request, the layout of the receive buffer (one
per reply, from a `BufferPool` of recycled buffers; each output array aligned to 64 bytes; a run of
ranges of one key merged into one array lands back to back), receiving inline bytes from the
socket, copying shared-memory pieces out of the peer's segments (`SegmentCache`), and the integrity
checks (crc32 of what crossed the wire, `sum64` of whole arrays read from shared memory, and of the
check blocks covering a sub-range, summed where they lie in the segment). Connections,
retries and timeouts are `client.py`'s.
"""

from __future__ import annotations

import weakref
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from earl_stream.errors import ProtocolError, StoreError
from earl_stream.store import wire
from earl_stream.store.shm import SegmentCache

ALIGN = 64  # every received piece starts at a multiple of this in the receive buffer
_U64 = np.dtype("<u8")
_U8 = np.dtype(np.uint8)
_MASK64 = (1 << 64) - 1
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


def pieces_of_tcp_reply(reply: wire.PullReply | wire.PullUcxReply) -> list[wire.ShmPiece]:
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
    sock: wire.Stream,
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
    ucx_receive: Callable[[list[tuple[int, np.ndarray]]], None] | None = None,
) -> Received:
    """The reply's pieces as arrays: views into one receive buffer, or (`zero_copy`) read-only views
    straight into the peer's segments for single pieces that lie there. With `merge_runs`, each run
    of consecutive pieces of one key comes back as one array (its ranges back to back).

    Inline pieces are read from `sock` (their bytes follow the header, in order); shm pieces are
    copied out of (or viewed in) the peer's segments. Every piece with a check is verified.
    With `ucx_receive`, inline pieces arrive over UCX instead: it gets (piece index, uint8 view to
    fill) for each of them and returns once they are filled.
    """
    if len(infos) != len(pieces):
        raise ProtocolError(f"asked for {len(pieces)} pieces, reply describes {len(infos)}")
    sizes, dts, offsets, runs, inline_bytes, total = _layout(pieces, infos, segments, merge_runs, zero_copy)
    if inline_bytes != payload_len:
        raise ProtocolError(f"reply payload is {payload_len} bytes, its inline pieces add up to {inline_bytes}")
    if total > max_bytes + ALIGN * len(runs):
        raise ProtocolError(f"reply of {total} bytes is over this client's max_payload={max_bytes}")
    buf = np.empty(max(total, 1), dtype=np.uint8) if buffers is None or total == 0 else buffers.take(total)
    if ucx_receive is None:
        _receive_inline(sock, deadline, buf, infos, offsets, sizes)
    else:
        ucx_receive([(i, buf[off : off + size]) for i, (info, off, size) in enumerate(zip(infos, offsets, sizes))
                     if info.segment < 0 and size])
    segs = _map_segments(address, segments, maps, fresh=zero_copy)
    _copy_and_verify(address, pieces, infos, offsets, sizes, buf, segs)
    out = []
    for first, stop in runs:
        off, size = offsets[first], sizes[first]
        if stop - first > 1:
            out.append(buf[off : offsets[stop - 1] + sizes[stop - 1]].view(dts[first]))
        elif off >= 0:
            out.append(buf[off : off + size].view(dts[first]))
        else:
            info = infos[first]
            out.append(segs[info.segment][info.offset : info.offset + size].view(dts[first]))
    return Received(out, bool(segments), segs if zero_copy else [])


def _copy_and_verify(
    address: str,
    pieces: Sequence[Piece],
    infos: Sequence[wire.ShmPiece],
    offsets: list[int],
    sizes: list[int],
    buf: np.ndarray,
    segs: list[np.ndarray],
) -> None:
    """Copy shared-memory pieces into `buf` (offset -1: left in place), then verify every piece with a check.

    The hot loop of a many-range pull (e.g. zig-zag context-parallel slices): memoryview copies (one
    memcpy each, no numpy dispatch) and plain integer arithmetic.
    """
    mbuf = memoryview(buf)
    msegs = [memoryview(s) for s in segs]
    words = [s.view(_U64) if s.nbytes % 8 == 0 else None for s in segs]  # segments are 2 MiB multiples
    add = np.add.reduce
    for i, info in enumerate(infos):
        seg, off, size = info.segment, offsets[i], sizes[i]
        if off >= 0 and seg >= 0 and size:
            at = info.offset
            mbuf[off : off + size] = msegs[seg][at : at + size]
        check = info.check
        if check < 0:
            continue
        if info.check_bytes:  # a sub-range: verified over the check blocks covering it, where they lie
            at, n, w = info.check_offset, info.check_bytes, words[seg]
            if w is not None and at % 8 == 0:  # always, for our nodes: `wire.sum64` without its slicing
                whole = n - n % 8
                got = int(add(w[at >> 3 : (at + whole) >> 3])) + n
                if whole != n:  # the array's last, partial word (zero-padded)
                    got += int.from_bytes(msegs[seg][at + whole : at + n], "little")
                got &= _MASK64
            else:
                got = wire.sum64(segs[seg][at : at + n])
        elif seg < 0:
            got = zlib.crc32(mbuf[off : off + size])
        else:
            got = wire.sum64(buf[off : off + size] if off >= 0 else segs[seg][info.offset : info.offset + size])
        if got != check:
            key, start, end = pieces[i]
            raise StoreError(
                f"checksum mismatch for {key!r} [{start}, {end}) from peer {address}: the bytes were corrupted "
                "in storage or in transit; treat this shard as lost"
            )


def _layout(
    pieces: Sequence[Piece], infos: Sequence[wire.ShmPiece], segments: Sequence[wire.ShmSegment], merge: bool, zero_copy: bool
) -> tuple[list[int], list[np.dtype], list[int], list[tuple[int, int]], int, int]:
    """One pass over the reply's piece table: every piece checked against the request and the
    segments' bounds, its byte size and dtype, and where it lands in the receive buffer.

    Returns (sizes, dtypes, buffer offsets (-1: read in place, zero copy), output runs as [first, stop)
    piece indices (runs of one key when merging, else single pieces), inline bytes, buffer bytes).
    Each output array starts at a multiple of ALIGN; a run's ranges lie back to back.
    """
    known: dict[str, np.dtype] = {}
    seg_sizes = [s.size for s in segments]
    n = len(pieces)
    sizes, dts, offsets = [0] * n, [_U8] * n, [-1] * n
    runs: list[tuple[int, int]] = []
    inline_bytes = total = run_total = 0
    prev_key = None
    for i, ((key, start, end), info) in enumerate(zip(pieces, infos)):
        dt = known.get(info.dtype)
        if dt is None:
            dt = known[info.dtype] = wire.storable_dtype(info.dtype)
        count, seg, offset = info.count, info.segment, info.offset
        if count != end - start:
            raise ProtocolError(f"piece {key!r}: asked {end - start} elements, reply has {count}")
        size = count * dt.itemsize
        if seg < 0:
            inline_bytes += size
        elif seg >= len(seg_sizes) or offset < 0 or offset + size > seg_sizes[seg]:
            raise ProtocolError(f"piece {key!r}: shared-memory location {seg}:{offset}+{size} is invalid")
        elif info.check_bytes and not (
            0 <= info.check_offset <= offset and offset + size <= info.check_offset + info.check_bytes <= seg_sizes[seg]
        ):
            raise ProtocolError(f"piece {key!r}: check blocks {info.check_offset}+{info.check_bytes} do not cover it")
        if merge and runs and key == prev_key:
            first = runs[-1][0]
            if dt != dts[first]:
                raise ProtocolError(f"ranges of {key!r} came back with different dtypes")
            if offsets[first] < 0:  # it was a lone zero-copy piece; now a run: copy it after all
                run_total = -(-total // ALIGN) * ALIGN
                offsets[first], total = run_total, run_total + sizes[first]
            runs[-1] = (first, i + 1)
        else:
            runs.append((i, i + 1))
            if zero_copy and seg >= 0:  # a lone piece in shared memory is read in place (unless a run follows)
                sizes[i], dts[i], prev_key = size, dt, key
                continue
            total = -(-total // ALIGN) * ALIGN
        offsets[i] = total
        total += size
        sizes[i], dts[i], prev_key = size, dt, key
    return sizes, dts, offsets, runs, inline_bytes, total


def _receive_inline(
    sock: wire.Stream, deadline: float, buf: np.ndarray, infos: Sequence[wire.ShmPiece], offsets: list[int], sizes: list[int]
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
