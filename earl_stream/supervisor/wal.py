"""The supervisor's write-ahead state: a snapshot plus an append-only log of what changed it since.

The supervisor is a state machine (`Supervisor.handle`: one message in, one reply out, no I/O), so its
state is its last snapshot plus every state-changing input since, replayed in order. The inputs are the
verified control messages it accepted (all but the read-only ones) and the events it decided itself (a
worker declared dead for a missed lease). Each is appended to `supervisor.wal` as a record

    u32 length | u32 crc32 | u64 sequence | u8 kind | body

(kind 1: the message's msgpack bytes as received; kind 2: a lease expiry, the worker id and reason).
The serve loop appends the records of a batch of messages, fsyncs the log once (group commit), and only
then sends the batch's replies: a peer never hears of a change that a crash could undo.

Every `snapshot_records` records (or `snapshot_interval_s`) the whole state is written to
`supervisor.state` (tmp file, fsync, rename, fsync of the directory) with the sequence number of the
last record it holds, and a new, empty log is started. On start the snapshot is loaded and the log's
later records are replayed; a torn last record (a crash mid-append) ends the log. A snapshot whose log
was not yet truncated is safe: records at or below its sequence number are skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import msgspec

from earl_stream import protocol as P
from earl_stream.errors import ConfigError
from earl_stream.files import fsync_dir, write_durably

if TYPE_CHECKING:
    from earl_stream.supervisor.server import Supervisor

log = logging.getLogger(__name__)
STATE_FILE = "supervisor.state"
LOG_FILE = "supervisor.wal"
_RECORD = struct.Struct("!IIQB")  # body length, crc32 of (sequence, kind, body), sequence, kind
MESSAGE, LEASE_EXPIRED = 1, 2
READ_ONLY = (P.StatusRequest, P.EnvList, P.RecentEpisodes)  # never logged: they change nothing


class LeaseExpired(msgspec.Struct, frozen=True):
    worker_id: str
    why: str


@dataclasses.dataclass
class WalStats:
    records: int = 0
    bytes_logged: int = 0  # log bytes appended
    bytes_snapshots: int = 0  # snapshot bytes written
    fsyncs: int = 0
    snapshots: int = 0


class StateLog:
    """Snapshot + log in `state_dir` for one supervisor (not shared between processes)."""

    def __init__(self, state_dir: Path, *, snapshot_records: int = 5000, snapshot_interval_s: float = 60.0) -> None:
        self.dir = state_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_path = state_dir / STATE_FILE
        self.log_path = state_dir / LOG_FILE
        self.snapshot_records = snapshot_records
        self.snapshot_interval_s = snapshot_interval_s
        self.seq = 0  # the sequence number of the last record appended
        self.stats = WalStats()
        self._since_snapshot = 0
        self._last_snapshot = time.monotonic()
        self._dirty = False
        self._log: BinaryIO | None = None  # opened by recover()

    # -- start ------------------------------------------------------------------------------------

    def recover(self, sup: Supervisor, now: float) -> int:
        """Load the snapshot and replay the log into `sup`; the number of records replayed."""
        snapshot_seq = 0
        if self.state_path.exists():
            data = self.state_path.read_bytes()
            try:
                snapshot_seq = sup.restore(data, now)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ConfigError(f"cannot resume from {self.state_path} ({exc}); it was written by another version "
                                  "of earl_stream or is damaged: move it away to start a fresh run") from None
        self.seq = snapshot_seq
        replayed = 0
        logging.disable(logging.INFO)  # the handlers' log lines were written when the messages first came
        try:
            for seq, kind, body in self._records():
                if seq <= snapshot_seq:
                    continue
                if kind == MESSAGE:
                    sup.handle(P.decode(body), now)
                else:
                    event = msgspec.msgpack.decode(body, type=LeaseExpired)
                    worker = sup.workers.get(event.worker_id)
                    if worker is not None and worker.alive:
                        sup.declare_dead(worker, event.why)
                self.seq, replayed = seq, replayed + 1
        finally:
            logging.disable(logging.NOTSET)
        self._log = self.log_path.open("ab")
        if replayed:
            log.info("replayed %d logged changes after the snapshot (sequence %d -> %d)", replayed, snapshot_seq, self.seq)
        return replayed

    def _records(self) -> Iterator[tuple[int, int, bytes]]:
        if not self.log_path.exists():
            return
        data = self.log_path.read_bytes()
        at = 0
        while at + _RECORD.size <= len(data):
            length, crc, seq, kind = _RECORD.unpack_from(data, at)
            body = data[at + _RECORD.size: at + _RECORD.size + length]
            if len(body) < length or zlib.crc32(struct.pack("!QB", seq, kind) + body) != crc:
                log.warning("%s ends with a torn record at byte %d (a crash mid-append): the log ends there",
                            self.log_path, at)
                break
            yield seq, kind, bytes(body)
            at += _RECORD.size + length

    # -- running ----------------------------------------------------------------------------------

    def append_message(self, msg: object, payload: bytes) -> None:
        """Log an accepted message (its verified msgpack bytes) unless it is read-only."""
        if not isinstance(msg, READ_ONLY):
            self._append(MESSAGE, payload)

    def append_lease_expired(self, worker_id: str, why: str) -> None:
        self._append(LEASE_EXPIRED, msgspec.msgpack.encode(LeaseExpired(worker_id, why)))

    def _append(self, kind: int, body: bytes) -> None:
        assert self._log is not None, "recover() first"
        self.seq += 1
        crc = zlib.crc32(struct.pack("!QB", self.seq, kind) + body)
        record = _RECORD.pack(len(body), crc, self.seq, kind) + body
        self._log.write(record)
        self.stats.records += 1
        self.stats.bytes_logged += len(record)
        self._since_snapshot += 1
        self._dirty = True

    def commit(self) -> None:
        """Make every appended record durable (one fsync for the batch) before its replies go out."""
        if self._dirty and self._log is not None:
            self._log.flush()
            os.fsync(self._log.fileno())
            self.stats.fsyncs += 1
            self._dirty = False

    def maybe_snapshot(self, sup: Supervisor, *, force: bool = False) -> None:
        due = self._since_snapshot >= self.snapshot_records or (
            self._since_snapshot and time.monotonic() - self._last_snapshot >= self.snapshot_interval_s)
        if force or due:
            self.snapshot(sup)

    def snapshot(self, sup: Supervisor) -> None:
        """Write the whole state atomically and durably, then start an empty log."""
        self.commit()
        data = sup.snapshot(wal_seq=self.seq)
        write_durably(self.state_path, data)
        if self._log is not None:
            self._log.close()
        self._log = self.log_path.open("wb")  # records up to self.seq live in the snapshot now
        fsync_dir(self.dir)
        self.stats.snapshots += 1
        self.stats.fsyncs += 3  # the snapshot, its directory entry, the new log's
        self.stats.bytes_snapshots += len(data)
        self._since_snapshot = 0
        self._last_snapshot = time.monotonic()

    def close(self, sup: Supervisor) -> None:
        self.snapshot(sup)
        if self._log is not None:
            self._log.close()
            self._log = None

