"""Shared-memory segments of the same-host transport: naming, the producer's pool, the consumer's maps.

Owns the files under /dev/shm that hold a node's shard bytes: `ShmPool` (a producer node's pooled,
pre-faulted segments, a first-fit allocator with coalescing, and reference counts so that a region is
reused only after its key was dropped AND every lease on it ended), `SegmentCache` (a consumer's
read-only, pre-faulted mappings, cached by segment name), the probe file a consumer opens to prove
that it sees this host's /dev/shm, and the removal of segments left behind by killed processes.

Names are `earl_stream-{pid}-{process start time}-{node tag}-{n}` (the probe ends in `-probe`), so a
node that finds a segment whose process no longer exists (or whose pid was reused) removes it. Files
are created mode 0600. What a key means, and when it is dropped, is the shard store's business.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from earl_stream.errors import ProtocolError, StoreError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "earl_stream-"
NAME_RE = re.compile(r"^earl_stream-(\d+)-(\d+)-([0-9a-f]{8})-(probe|\d+)$")
ALIGN = 64  # every region starts at a multiple of this (cache line)
PAGE = 1 << 21  # segment sizes are multiples of 2 MiB (huge-page friendly)
PROBE_BYTES = 64


def shm_supported() -> bool:
    """True where /dev/shm exists and is writable (Linux)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def _start_time(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks (field 22 of /proc/pid/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19])


def cleanup_stale_segments() -> list[str]:
    """Remove this user's segments whose creating process is gone; returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = NAME_RE.match(name)
        if not m:
            continue
        pid, started = int(m.group(1)), int(m.group(2))
        if _start_time(pid) == started:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid != uid:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue  # another process removed it first
    if removed:
        log.info("removed %d shared-memory segment(s) left by dead processes: %s", len(removed), removed[:5])
    return removed


def _create(name: str, size: int, populate: bool) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        # MAP_POPULATE faults every page in now: first touch runs at ~0.5 GiB/s, later copies at memcpy speed.
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)


def _unlink(names: list[str], owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return  # a forked child exiting must not remove its parent's segments
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


@dataclass(eq=False)
class Region:
    """`nbytes` bytes at `offset` of segment `segment`; `refs` = 1 (held by the store) + active leases."""

    segment: int
    offset: int
    nbytes: int
    size: int  # bytes taken from the segment (nbytes rounded up to ALIGN)
    refs: int = 1


class _Segment:
    def __init__(self, name: str, size: int, buf: mmap.mmap) -> None:
        self.name, self.size, self.buf = name, size, buf
        self.array = np.frombuffer(buf, dtype=np.uint8)
        self.free_offsets = [0]  # sorted starts of free extents
        self.free_sizes = {0: size}
        self.used = 0


class ShmPool:
    """A producer node's shared-memory segments and the allocator over them. Thread-safe.

    Segments grow geometrically from `first_segment_bytes` to `segment_bytes`, up to `max_bytes` in
    total; each is pre-faulted when created and kept for reuse until `close`. `alloc` returns None
    when the request cannot be placed (larger than a segment, or the cap is reached): the caller then
    keeps the bytes in private memory and serves them inline over the socket.
    """

    def __init__(self, *, max_bytes: int = 1 << 30, segment_bytes: int = 64 << 20, first_segment_bytes: int = 4 << 20) -> None:
        if not shm_supported():
            raise StoreError(f"{SHM_DIR} is not available; create the node with shm=False")
        cleanup_stale_segments()
        pid = os.getpid()
        self._tag = f"{NAME_PREFIX}{pid}-{_start_time(pid)}-{os.urandom(4).hex()}"
        self._segment_bytes = _round_up(segment_bytes, PAGE)
        self._next_bytes = min(_round_up(first_segment_bytes, PAGE), self._segment_bytes)
        self._max_bytes = max_bytes
        self._segments: list[_Segment] = []
        self._growing = 0  # bytes of segments being created outside the lock
        self._created = 0
        self._lock = threading.Lock()
        self._closed = False
        self.token = os.urandom(32)
        self.probe_name = f"{self._tag}-probe"
        probe = _create(self.probe_name, PROBE_BYTES, populate=False)
        probe[: len(self.token)] = self.token
        probe.close()
        self._names = [self.probe_name]  # shared with the finalizer: unlinked at exit even without close()
        self._finalizer = weakref.finalize(self, _unlink, self._names, pid)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of /dev/shm this pool holds (all segments, used or not)."""
        return sum(s.size for s in self._segments)

    @property
    def used_bytes(self) -> int:
        return sum(s.used for s in self._segments)

    def segment_names(self) -> list[str]:
        with self._lock:
            return list(self._names)

    def segment(self, index: int) -> tuple[str, int]:
        seg = self._segments[index]
        return seg.name, seg.size

    def alloc(self, nbytes: int) -> Region | None:
        size = max(_round_up(nbytes, ALIGN), ALIGN)
        if size > self._segment_bytes:
            return None
        while True:
            with self._lock:
                if self._closed:
                    return None
                for index, seg in enumerate(self._segments):
                    region = self._take(index, seg, size, nbytes)
                    if region is not None:
                        return region
                new = max(self._next_bytes, _round_up(size, PAGE))
                if self.reserved_bytes + self._growing + new > self._max_bytes:
                    return None
                self._growing += new
                name = f"{self._tag}-{self._created}"
                self._created += 1
                self._names.append(name)  # from now on close() (or exit) unlinks it
            # Pre-faulting runs at ~0.5 GiB/s: never under the lock that every pull's lease needs.
            try:
                seg = _Segment(name, new, _create(name, new, populate=True))
            finally:
                with self._lock:
                    self._growing -= new
            with self._lock:
                if self._closed:  # closed while we created it: its unlink may have come too early
                    _unlink([name], os.getpid())
                    seg.array = np.empty(0, np.uint8)
                    seg.buf.close()
                    return None
                self._segments.append(seg)
                self._next_bytes = min(self._next_bytes * 2, self._segment_bytes)
            log.debug("shared-memory pool grew by %d bytes (%s)", new, name)

    @staticmethod
    def _take(index: int, seg: _Segment, size: int, nbytes: int) -> Region | None:
        for i, start in enumerate(seg.free_offsets):
            have = seg.free_sizes[start]
            if have >= size:
                del seg.free_offsets[i]
                del seg.free_sizes[start]
                if have > size:
                    seg.free_offsets.insert(i, start + size)
                    seg.free_sizes[start + size] = have - size
                seg.used += size
                return Region(index, start, nbytes, size)
        return None

    def view(self, region: Region) -> np.ndarray:
        """Writable uint8 view of the region (the store writes it once, before publishing the key)."""
        return self._segments[region.segment].array[region.offset : region.offset + region.nbytes]

    def acquire_many(self, regions: list[Region]) -> None:
        with self._lock:
            for region in regions:
                assert region.refs > 0, "lease on a freed region"
                region.refs += 1

    def release(self, region: Region) -> None:
        """Drop one reference; the bytes return to the free list when the last one goes."""
        with self._lock:
            region.refs -= 1
            assert region.refs >= 0, "region released twice"
            if region.refs == 0 and not self._closed:
                self._free(self._segments[region.segment], region.offset, region.size)

    @staticmethod
    def _free(seg: _Segment, start: int, size: int) -> None:
        seg.used -= size
        i = bisect.bisect_left(seg.free_offsets, start)
        if i < len(seg.free_offsets) and seg.free_offsets[i] == start + size:  # merge with the next extent
            size += seg.free_sizes.pop(seg.free_offsets.pop(i))
        if i > 0 and seg.free_offsets[i - 1] + seg.free_sizes[seg.free_offsets[i - 1]] == start:  # and the previous
            prev = seg.free_offsets[i - 1]
            seg.free_sizes[prev] += size
            return
        seg.free_offsets.insert(i, start)
        seg.free_sizes[start] = size

    def close(self) -> None:
        """Unlink every segment; mappings go when the last view of them does."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
        for seg in self._segments:
            seg.array = np.empty(0, np.uint8)
            try:
                seg.buf.close()
            except BufferError:
                pass  # a view is still alive somewhere; the kernel frees the pages when it dies


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def read_probe(name: str, token: bytes) -> bool:
    """Whether this process sees the peer's /dev/shm: its probe file holds the token it announced."""
    if not NAME_RE.match(name) or not name.endswith("-probe"):
        return False
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return os.pread(fd, len(token), 0) == token
    except OSError:
        return False
    finally:
        os.close(fd)


class SegmentCache:
    """A consumer's read-only mappings of peers' segments, by name (LRU, at most `max_segments`).

    Names are never reused, so a cached mapping is always the segment a reply names. Mapping with
    MAP_POPULATE pre-faults the page tables once; later copies out of it run at memcpy speed.
    """

    def __init__(self, max_segments: int = 256) -> None:
        self._maps: OrderedDict[str, tuple[mmap.mmap, np.ndarray]] = OrderedDict()
        self._max = max_segments
        self._lock = threading.Lock()

    def get(self, name: str, size: int, *, fresh: bool = False) -> np.ndarray:
        """Read-only uint8 array over segment `name`, which the peer says is `size` bytes (else
        ProtocolError). `fresh`: a new array object (same mapping), for a caller that must know when
        every view of it is gone."""
        with self._lock:
            hit = self._maps.get(name)
            if hit is not None:
                self._maps.move_to_end(name)
                return np.frombuffer(hit[0], dtype=np.uint8) if fresh else hit[1]
        if not NAME_RE.match(name) or name.endswith("-probe"):
            raise ProtocolError(f"peer named shared-memory segment {name!r}, which is not one of ours")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise StoreError(f"cannot open shared-memory segment {name}: {exc}") from exc
        try:
            real = os.fstat(fd).st_size
            if real != size or size <= 0:
                raise ProtocolError(f"segment {name} is {real} bytes, the peer said {size}")
            buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        array = np.frombuffer(buf, dtype=np.uint8)
        with self._lock:
            self._maps[name] = (buf, array)
            while len(self._maps) > self._max:
                self._maps.popitem(last=False)  # the mapping goes once no copy-out still views it
        return np.frombuffer(buf, dtype=np.uint8) if fresh else array

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
