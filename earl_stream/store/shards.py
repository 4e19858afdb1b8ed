"""A node's shard storage: immutable 1-D arrays by key, byte accounting, back-pressure and leases.

Owns `ShardStore`. With a `ShmPool`, `put` copies each array into a pooled shared-memory region (so
same-host peers can copy it out directly); without one, or when the pool cannot place it, the store
keeps the caller's array itself (no copy). `resolve` hands out `Lease`s: a region is reused only after
its key was dropped and every lease on it was released, so a reader (a socket send, or a peer copying
out of shared memory) never sees bytes of a later put. Serving connections is `node.py`'s business.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from earl_stream.errors import StoreError
from earl_stream.store import wire
from earl_stream.store.shm import Region, ShmPool
from earl_stream.store.wire import ErrorCode


class RequestError(Exception):
    """A request names something the store cannot serve; answered with an ERROR frame of `code`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Shard:
    array: np.ndarray  # 1-D, C-contiguous, read-only (a view into `region` when it lives in the pool)
    sum64: int  # `wire.sum64` of the whole array's bytes, taken at put: the reference against bit rot
    blocks: np.ndarray  # uint64 [nblocks + 1]: running word sums of CHECK_BLOCK-byte blocks (sub-range checks)
    region: Region | None
    dtype: str  # the array's dtype string, itemsize and length, kept at hand for the thousands of
    itemsize: int  # pieces a request resolves
    count: int


CHECK_BLOCK = 1024  # bytes per check block: a sub-range is verified over the blocks covering it
_MASK64 = (1 << 64) - 1


class Span(NamedTuple):
    """The check blocks covering a sub-range: put-time `sum64` of their bytes, their start (bytes from
    the start of the array) and length, and (when the array is at hand) a uint8 view of them."""

    check: int
    start: int
    nbytes: int
    view: np.ndarray | None
    seg_offset: int = -1  # where the blocks start in the shared-memory segment (-1: not in one)


class Piece(NamedTuple):
    """A resolved request piece: its key, the elements' view (None for a shared-memory piece unless
    asked for), dtype string, element count, the put-time `sum64` when the piece is the whole array
    (else None), and where it lives in shared memory (segment, byte offset; -1, 0 if not). A tuple:
    thousands are built per request."""

    key: str
    array: np.ndarray | None
    dtype: str
    count: int  # type: ignore[assignment]  # the wire's name for it; shadows tuple.count, which no caller uses
    sum64: int | None
    segment: int
    offset: int
    span: Span | None = None  # for a sub-range: the blocks to verify it against


class Lease:
    """Regions a reader is using; `release` (idempotent) lets them be reused."""

    def __init__(self, pool: ShmPool | None, regions: list[Region]) -> None:
        self._pool, self._regions = pool, regions

    def release(self) -> None:
        regions, self._regions = self._regions, []
        for region in regions:
            assert self._pool is not None
            self._pool.release(region)


class ShmResolved(NamedTuple):
    """What `ShardStore.resolve_shm` found: the reply's piece table (None: an inline piece), the pool
    segment ids it numbers, the inline pieces by position, and the lease on the regions."""

    infos: list[wire.ShmPiece | None]
    segments: list[int]
    inline: list[tuple[int, Piece]]
    lease: Lease


class ShardStore:
    """Thread-safe key -> immutable array map with byte accounting and optional capacity."""

    def __init__(self, max_bytes: int | None, put_timeout_s: float, pool: ShmPool | None) -> None:
        self._shards: dict[str, _Shard] = {}
        self._crcs: dict[str, int] = {}  # crc32 of whole arrays, taken when first sent over a wire
        self._held = 0
        self._max_bytes = max_bytes
        self._put_timeout_s = put_timeout_s
        self._pool = pool
        self._closed = False
        self._cond = threading.Condition()

    @property
    def bytes_held(self) -> int:
        return self._held

    @property
    def pool(self) -> ShmPool | None:
        return self._pool

    def put_many(self, items: Mapping[str, np.ndarray]) -> None:
        shards = {key: _prepare(key, arr) for key, arr in items.items()}
        need = sum(s.array.nbytes for s in shards.values())
        with self._cond:
            self._refuse_existing(shards)
            cap = self._max_bytes
            if cap is not None and need > 0:
                if need > cap:
                    raise StoreError(f"{need} bytes can never fit in a node capped at max_bytes={cap}")
                fits = self._cond.wait_for(
                    lambda: self._closed or self._held + need <= cap, timeout=self._put_timeout_s
                )
                if not fits:
                    raise StoreError(
                        f"back-pressure: node holds {self._held} of max_bytes={self._max_bytes}; {need} more bytes "
                        f"did not fit within {self._put_timeout_s}s. Consumers must release (drop) pulled shards."
                    )
                self._refuse_existing(shards)  # someone may have put the same key while we waited
            if self._closed:
                raise StoreError("shard node is closed")
            self._held += need  # reserved now, so that concurrent puts respect the cap while we copy
        placed: dict[str, _Shard] = {}
        try:
            for key, shard in shards.items():
                placed[key] = self._place(shard)
        except BaseException:
            self._unreserve(placed.values(), need)
            raise
        with self._cond:
            clash = self._closed or any(k in self._shards for k in placed)
            if not clash:
                self._shards.update(placed)  # published: complete bytes only, all keys at once
        if clash:
            self._unreserve(placed.values(), need)
            raise StoreError("shard node is closed" if self._closed else f"keys are immutable once put: {list(placed)[:5]}")

    def _unreserve(self, shards: Iterable[_Shard], need: int) -> None:
        with self._cond:
            self._held -= need
            self._cond.notify_all()
        for shard in shards:
            if shard.region is not None and self._pool is not None:
                self._pool.release(shard.region)

    def _place(self, shard: _Shard) -> _Shard:
        """Copy into a pooled region when there is one (outside the lock: the copy is the slow part)."""
        if self._pool is None or shard.array.nbytes == 0:
            return shard
        region = self._pool.alloc(shard.array.nbytes)
        if region is None:
            return shard
        dst = self._pool.view(region)
        np.copyto(dst, shard.array.view(np.uint8))
        view = dst.view(shard.array.dtype)
        view.flags.writeable = False
        return dataclasses.replace(shard, array=view, region=region)

    def _refuse_existing(self, shards: Mapping[str, _Shard]) -> None:
        dup = [k for k in shards if k in self._shards]
        if dup:
            raise StoreError(f"keys are immutable once put; already held: {dup[:5]}{' ...' if len(dup) > 5 else ''}")

    def drop(self, keys: Iterable[str]) -> int:
        regions = []
        with self._cond:
            freed = 0
            for key in keys:
                shard = self._shards.pop(key, None)
                self._crcs.pop(key, None)
                if shard is not None:
                    freed += shard.array.nbytes
                    if shard.region is not None:
                        regions.append(shard.region)
            self._held -= freed
            self._cond.notify_all()
        Lease(self._pool, regions).release()  # bytes under a live lease return to the pool when it ends
        return freed

    def drop_prefix(self, prefix: str) -> int:
        with self._cond:
            keys = [k for k in self._shards if k.startswith(prefix)]
        return self.drop(keys)

    def keys(self) -> list[str]:
        with self._cond:
            return list(self._shards)

    def copy(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """Private copies of the whole arrays held under `keys` (absent keys are left out): a dropped
        key's region cannot be reused while the lock is held."""
        with self._cond:
            return {k: self._shards[k].array.copy() for k in keys if k in self._shards}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def resolve(self, pieces: Sequence[tuple[str, int, int]], *, arrays: bool = True) -> tuple[list[Piece], Lease]:
        """Validate pieces, look them up, and lease their regions (release the lease when done reading).

        `arrays=False` spares the element views of pieces in shared memory (their readers map them).
        """
        out: list[Piece] = []
        regions: list[Region] = []
        with self._cond:
            for key, start, end in pieces:
                shard = self._shards.get(key)
                if shard is None:
                    raise RequestError(ErrorCode.UNKNOWN_KEY, f"no shard under key {key!r}")
                n = shard.count
                if not 0 <= start <= end <= n:
                    raise RequestError(ErrorCode.BAD_RANGE, f"range [{start}, {end}) outside [0, {n}] of key {key!r}")
                whole = start == 0 and end == n
                check = shard.sum64 if whole else None
                region = shard.region
                span = None if whole else _span(shard, start, end, arrays or region is None, -1 if region is None else region.offset)
                if region is None:
                    out.append(Piece(key, shard.array[start:end], shard.dtype, end - start, check, -1, 0, span))
                    continue
                if not regions or regions[-1] is not region:
                    regions.append(region)
                view = shard.array[start:end] if arrays else None
                off = region.offset + start * shard.itemsize
                out.append(Piece(key, view, shard.dtype, end - start, check, region.segment, off, span))
            if regions:
                assert self._pool is not None  # regions imply a pool
                self._pool.acquire_many(regions)
        return out, Lease(self._pool, regions)

    def resolve_shm(self, pieces: Sequence[tuple[str, int, int]]) -> ShmResolved:
        """`resolve` for a PULL_SHM reply, in one pass straight to its piece table (the hot path of
        many-range pulls): a `wire.ShmPiece` per piece, its segment numbered in order of first use
        (`segments` lists the pool's segment ids); pieces outside shared memory get a None entry and
        their `Piece` in `inline` (position, piece): the caller fills in their crc32."""
        infos: list[wire.ShmPiece | None] = []
        segments: list[int] = []
        seg_index: dict[int, int] = {}
        inline: list[tuple[int, Piece]] = []
        regions: list[Region] = []
        with self._cond:
            shards = self._shards
            for key, start, end in pieces:
                shard = shards.get(key)
                if shard is None:
                    raise RequestError(ErrorCode.UNKNOWN_KEY, f"no shard under key {key!r}")
                n = shard.count
                if not 0 <= start <= end <= n:
                    raise RequestError(ErrorCode.BAD_RANGE, f"range [{start}, {end}) outside [0, {n}] of key {key!r}")
                region = shard.region
                if region is None:
                    whole = start == 0 and end == n
                    span = None if whole else _span(shard, start, end, True, -1)
                    piece = Piece(key, shard.array[start:end], shard.dtype, end - start, shard.sum64 if whole else None, -1, 0, span)
                    inline.append((len(infos), piece))
                    infos.append(None)
                    continue
                if not regions or regions[-1] is not region:
                    regions.append(region)
                si = seg_index.get(region.segment)
                if si is None:
                    si = seg_index[region.segment] = len(segments)
                    segments.append(region.segment)
                off = region.offset + start * shard.itemsize
                if start == 0 and end == n:  # the reader verifies a whole array after its copy
                    infos.append(wire.ShmPiece(shard.dtype, n, shard.sum64, si, off))
                elif start == end:
                    infos.append(wire.ShmPiece(shard.dtype, 0, -1, si, off))
                else:  # ... and a sub-range over the check blocks covering it, where they lie (`_span`, inlined)
                    isz, blocks = shard.itemsize, shard.blocks
                    first = start * isz // CHECK_BLOCK
                    last = min(-(-end * isz // CHECK_BLOCK), blocks.shape[0] - 1)
                    lo, hi = first * CHECK_BLOCK, min(last * CHECK_BLOCK, n * isz)
                    check = (blocks.item(last) - blocks.item(first) + hi - lo) & _MASK64
                    infos.append(wire.ShmPiece(shard.dtype, end - start, check, si, off, region.offset + lo, hi - lo))
            if regions:
                assert self._pool is not None  # regions imply a pool
                self._pool.acquire_many(regions)
        return ShmResolved(infos, segments, inline, Lease(self._pool, regions))

    def manifest(self, prefix: str) -> list[wire.ManifestEntry]:
        with self._cond:
            items = [(k, s) for k, s in self._shards.items() if k.startswith(prefix)]
        return [wire.ManifestEntry(k, s.array.dtype.str, [int(s.array.shape[0])]) for k, s in sorted(items)]

    def corrupt_for_test(self, key: str, byte_index: int) -> None:
        """Flip one stored byte, keeping the old checks: models bit rot at rest (in place when in shm)."""
        with self._cond:
            shard = self._shards[key]
            if shard.region is not None:
                assert self._pool is not None
                self._pool.view(shard.region)[byte_index] ^= 0xFF
                return
            raw = shard.array.view(np.uint8).copy()
            raw[byte_index] ^= 0xFF
            broken = raw.view(shard.array.dtype)
            broken.flags.writeable = False
            self._shards[key] = dataclasses.replace(shard, array=broken, region=None)

    def wire_crc(self, piece: Piece) -> int:
        """crc32 of a piece about to cross a wire. A whole array is first checked against its put-time
        `sum64` (RequestError CORRUPT if bit rot hit it) and its crc is kept for the next sender."""
        assert piece.array is not None, "resolve(arrays=True) for pieces that cross a wire"
        if piece.sum64 is None:
            span = piece.span
            if span is not None and span.nbytes and (span.view is None or wire.sum64(span.view) != span.check):
                raise RequestError(
                    ErrorCode.CORRUPT,
                    f"checksum mismatch for {piece.key!r} near bytes [{span.start}, {span.start + span.nbytes}): this node's "
                    "copy is corrupt; treat the shard as lost",
                )
            return zlib.crc32(piece.array.view(np.uint8))
        with self._cond:
            crc = self._crcs.get(piece.key)
        if crc is not None:
            return crc
        raw = piece.array.view(np.uint8)
        if wire.sum64(raw) != piece.sum64:
            raise RequestError(
                ErrorCode.CORRUPT, f"checksum mismatch for {piece.key!r}: this node's copy is corrupt; treat the shard as lost"
            )
        crc = zlib.crc32(raw)
        with self._cond:
            if piece.key in self._shards:
                self._crcs[piece.key] = crc
        return crc


def _prepare(key: str, arr: np.ndarray) -> _Shard:
    if not isinstance(key, str) or not key:
        raise StoreError(f"shard keys are non-empty strings, got {key!r}")
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise StoreError(f"shard {key!r} must be a 1-D numpy array, got {type(arr).__name__} {getattr(arr, 'shape', '')}")
    if arr.dtype.kind not in wire.STORABLE_KINDS or arr.dtype.hasobject:
        raise StoreError(f"shard {key!r} has dtype {arr.dtype}; only fixed-size numeric dtypes can be stored")
    view = np.ascontiguousarray(arr).view()
    view.flags.writeable = False
    blocks = _block_sums(view.view(np.uint8))
    total = (int(blocks[-1]) + view.nbytes) & _MASK64
    return _Shard(view, total, blocks, None, view.dtype.str, view.itemsize, view.shape[0])


def _block_sums(raw: np.ndarray) -> np.ndarray:
    """Running word sums (`wire.word_sum`) of the CHECK_BLOCK-byte blocks of `raw`: uint64 [nblocks + 1],
    entry k = sum of blocks [0, k) mod 2**64. One pass over the bytes."""
    n = raw.shape[0]
    full = n // CHECK_BLOCK
    sums = np.zeros(-(-n // CHECK_BLOCK) + 1, dtype=np.uint64)
    if full:
        words = raw[: full * CHECK_BLOCK].view("<u8").reshape(full, CHECK_BLOCK // 8)
        np.add.reduce(words, axis=1, dtype=np.uint64, out=sums[1 : full + 1])
    if n > full * CHECK_BLOCK:
        sums[-1] = wire.word_sum(raw[full * CHECK_BLOCK :])
    np.cumsum(sums, out=sums)  # uint64 wraps: sums mod 2**64, as word_sum
    return sums


def _span(shard: _Shard, start: int, end: int, with_view: bool, region_offset: int) -> Span:
    """The check blocks covering elements [start, end) of `shard` (whose region starts at `region_offset`
    of its segment; -1: not in shared memory)."""
    first = start * shard.itemsize // CHECK_BLOCK
    last = min(-(-end * shard.itemsize // CHECK_BLOCK), shard.blocks.shape[0] - 1)
    if last <= first:  # an empty range: nothing to verify
        return Span(-1, 0, 0, None)
    lo, hi = first * CHECK_BLOCK, min(last * CHECK_BLOCK, shard.count * shard.itemsize)
    check = (shard.blocks.item(last) - shard.blocks.item(first) + hi - lo) & _MASK64
    view = shard.array.view(np.uint8)[lo:hi] if with_view else None
    return Span(check, lo, hi - lo, view, -1 if region_offset < 0 else region_offset + lo)
