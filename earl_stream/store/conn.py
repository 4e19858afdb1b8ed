"""A `ShardClient`'s state per peer: the socket, its transport, and zero-copy leases to end.

Owns `PeerConn` (one persistent connection: its lock, the `Transport` its pulls go through, and
the held leases whose arrays are gone and must be reported to the node) and `LeaseToken` (counts the
live base arrays of one zero-copy reply), and the `Transport` protocol whose implementations (TCP, shared memory,
UCX) are `transport.py`'s. Requests and replies are `client.py`'s and `receive.py`'s.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from earl_stream.store import wire

if TYPE_CHECKING:
    import numpy as np

    from earl_stream.store.receive import Piece


class Transport(Protocol):
    """The bytes of one connection's pulls. `pull` runs under the connection's lock, on its socket."""

    name: ClassVar[str]  # 'tcp', 'shm' or 'ucx', as `ShardClient.transport(address)` reports it

    def pull(self, conn: PeerConn, deadline: float, pieces: list[Piece], zero_copy: bool, merge_runs: bool) -> list[np.ndarray]:
        """One 1-D array per piece (or per run of one key, with `merge_runs`), verified against the
        peer's checksums. `zero_copy` is honoured where the transport can (shared memory); elsewhere
        the arrays are copies. Errors as `ShardClient.pull`."""
        ...


@dataclass
class PeerConn:
    """One persistent connection to a peer; `lock` serialises its requests."""

    address: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: wire.Stream | None = None
    transport: Transport | None = None  # how its pulls' bytes travel (shm, UCX, TCP), chosen at connect
    generation: int = 0  # bumped on close: held leases of an older connection died with it
    released: deque[int] = field(default_factory=deque)  # held leases whose arrays are gone, to tell the peer

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
                self.transport = None
                self.generation += 1
                self.released.clear()

    def flush_released(self) -> None:
        """Tell the peer which held leases ended (caller holds `lock`); one-way, nothing to wait for."""
        ids = []
        while self.released:  # deque pops are atomic: a finalizer may append meanwhile, from any thread
            ids.append(self.released.popleft())
        if ids and self.sock is not None:
            self.sock.sendall(wire.encode_frame(wire.ShmDone(ids)))

    def release_later(self, generation: int, lease_id: int) -> None:
        """Finalizer of zero-copy arrays: end their lease now if the connection is free, else after its
        current request. Never blocks (it may run inside this connection's own request)."""
        if generation != self.generation:
            return
        self.released.append(lease_id)
        if self.lock.acquire(blocking=False):
            try:
                if generation == self.generation:
                    self.flush_released()
            except OSError:
                self.close()
            finally:
                self.lock.release()


class LeaseToken:
    """Counts the live base arrays of one zero-copy reply; the last one to go ends the lease."""

    def __init__(self, conn: PeerConn, generation: int, lease_id: int, bases: int) -> None:
        self._conn, self._generation, self._id, self._left = conn, generation, lease_id, bases
        self._lock = threading.Lock()

    def drop(self) -> None:
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            self._conn.release_later(self._generation, self._id)
