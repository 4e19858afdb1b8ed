"""The shard node: serves a process's tensor shards to pulling peers over TCP and shared memory.

Owns `ShardNode`: the listening socket, one thread per connection, authentication, the answers to
PULL / PULL_SHM / MANIFEST (and to extra request kinds a caller registers, e.g. the central
dispatcher's GATHER), and the per-connection leases on shared-memory regions. Storage, accounting and
leases are `shards.py`'s, segments `shm.py`'s, framing `wire.py`'s; what a key means (samples,
weights) is `experience.py`'s and `weights.py`'s. Ownership: after `put` the caller must not write
to the array (without shared memory the node keeps it as is; with it the node copies it into a
pooled segment). Bytes are freed when the key is dropped and no peer is still reading them.
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import msgspec
import numpy as np

from earl_stream.errors import ProtocolError, StoreError
from earl_stream.security import encryption
from earl_stream.store import ucx as ucx_transport
from earl_stream.store import wire
from earl_stream.store.frame_mac import AuthedStream, session_key
from earl_stream.store.shards import Lease, RequestError, ShardStore
from earl_stream.store.shm import ShmPool, shm_supported
from earl_stream.store.wire import ErrorCode, FrameError, Kind

log = logging.getLogger(__name__)
# An extra request handler: gets the decoded header, returns the reply header (no payload).
Handler = Callable[[Any], msgspec.Struct]


class ShardNode:
    """Holds tensor shards of this process and serves them to pulling peers.

    `host`/`port`: where to listen (port 0 picks a free one); `secret`: if set (the cluster secret or a worker
    key: both give the data-plane key, `security.keys.plane_key`), peers must prove it (HMAC) before any
    request, shared-memory offers included; `max_bytes`: capacity, `put` blocks up to `put_timeout_s` for room;
    `max_payload`: largest reply in bytes; `frame_timeout_s`: how long a started frame may take to arrive (or a
    reply to drain); `advertise_host`: host part of `.address` when listening on 0.0.0.0. `shm`: keep shards in
    pooled /dev/shm segments that same-host peers copy out of directly (None: wherever /dev/shm is usable);
    `shm_max_bytes`: cap of the pool (default: `max_bytes`, else 1 GiB; arrays that do not fit stay private and
    travel inline); `shm_segment_bytes`: largest segment (and largest array placed in shared memory);
    `handlers`: extra request kinds, header type -> function returning the reply header. `ucx`: offer the UCX
    transport to peers that ask (None: when `ucxx` imports and peers must prove `secret`, since UCX aborts the
    process on a malformed worker address; its worker starts on first use). `encrypt`: encrypt the frames after
    the handshake (None: $EARL_STREAM_ENCRYPT; needs `secret`; no UCX then).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        max_bytes: int | None = None,
        put_timeout_s: float = 30.0,
        max_payload: int = wire.DEFAULT_MAX_PAYLOAD_BYTES,
        frame_timeout_s: float = 30.0,
        advertise_host: str | None = None,
        shm: bool | None = None,
        shm_max_bytes: int | None = None,
        shm_segment_bytes: int = 64 << 20,
        handlers: Mapping[type[msgspec.Struct], Handler] | None = None,
        ucx: bool | None = None,
        encrypt: bool | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise StoreError(f"max_bytes must be positive or None, got {max_bytes}")
        use_shm = shm_supported() if shm is None else shm
        pool = None
        if use_shm:
            cap = shm_max_bytes if shm_max_bytes is not None else (max_bytes if max_bytes is not None else 1 << 30)
            pool = ShmPool(max_bytes=cap, segment_bytes=shm_segment_bytes)
        self._store = ShardStore(max_bytes, put_timeout_s, pool)
        self._handlers = dict(handlers or {})
        self._encrypt = encryption.encrypt_enabled(encrypt)
        if self._encrypt and secret is None:
            raise StoreError("an encrypting shard node (security.encrypt) needs the cluster secret: its keys come from it")
        # UCX bytes are not encrypted: an encrypting node never offers UCX
        self._ucx = False if self._encrypt else (ucx_transport.ucx_available() and secret is not None) if ucx is None else ucx
        self._secret = wire.data_key(secret)
        self._max_payload = max_payload
        self._frame_timeout_s = frame_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except BaseException:
            if pool is not None:
                pool.close()
            raise
        self._listener.setblocking(False)
        bound_port = self._listener.getsockname()[1]
        shown = advertise_host or host
        self.address = f"[{shown}]:{bound_port}" if ":" in shown else f"{shown}:{bound_port}"
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"shard-node-{bound_port}", daemon=True)
        self._accept_thread.start()

    # --- storage API ---------------------------------------------------------------------------------

    def put(self, key: str, array: np.ndarray) -> None:
        """Store a complete 1-D array under `key` (visible to pulls only once this returns)."""
        self._store.put_many({key: array})

    def put_many(self, items: Mapping[str, np.ndarray]) -> None:
        """Store several arrays atomically: all become visible together, or none (StoreError)."""
        self._store.put_many(items)

    def drop(self, keys: Iterable[str]) -> int:
        """Forget keys (unknown ones are ignored); returns bytes freed."""
        return self._store.drop(keys)

    def drop_prefix(self, prefix: str) -> int:
        return self._store.drop_prefix(prefix)

    @property
    def bytes_held(self) -> int:
        return self._store.bytes_held

    @property
    def shm_enabled(self) -> bool:
        return self._store.pool is not None

    def shm_segment_names(self) -> list[str]:
        """Files under /dev/shm this node owns (its probe and its segments); empty without shm."""
        pool = self._store.pool
        return [] if pool is None else pool.segment_names()

    def keys(self) -> list[str]:
        return self._store.keys()

    def copy(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """Private copies of the arrays under `keys` that this node holds (e.g. to persist them)."""
        return self._store.copy(keys)

    def _corrupt_for_test(self, key: str, byte_index: int = 0) -> None:
        """Test hook: flip one stored byte of `key` without updating its checksum."""
        self._store.corrupt_for_test(key, byte_index)

    # --- server --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, close every connection, join the server threads and unlink shared memory."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._store.close()
        self._wake_w.send(b"x")
        self._accept_thread.join()
        with self._conns_lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, thread in conns:
            thread.join(timeout=5.0)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        if self._store.pool is not None:
            self._store.pool.close()

    def __enter__(self) -> ShardNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for _key, _ in sel.select():
                    if self._stopping.is_set():
                        return
                    try:
                        sock, peer = self._listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:
                        log.warning("shard node %s: accept failed: %s", self.address, exc)
                        time.sleep(0.1)  # e.g. out of file descriptors: do not spin on a readable listener
                        continue
                    thread = threading.Thread(target=self._serve, args=(sock, peer), daemon=True, name="shard-conn")
                    with self._conns_lock:
                        self._conns[sock] = thread
                    thread.start()

    def _serve(self, sock: socket.socket, peer: tuple) -> None:
        where = f"shard node {self.address}, peer {peer[0]}:{peer[1]}"
        leases = _ConnLeases()
        try:
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._frame_timeout_s)
            nonce = os.urandom(wire.NONCE_BYTES)
            sock.sendall(wire.encode_frame(wire.Challenge(nonce, self._secret is not None, self._encrypt)))
            self._conversation(sock, nonce, where, leases)
        except FrameError as exc:
            log.warning("%s: %s; closing the connection", where, exc)
            self._try_send_error(sock, exc.code, str(exc))
        except wire.PeerClosed as exc:
            if not self._stopping.is_set():
                log.warning("%s: disconnected mid-frame (%s)", where, exc)
        except TimeoutError:
            log.warning("%s: frame or reply stalled for over %.0fs; closing the connection", where, self._frame_timeout_s)
        except OSError as exc:
            if not self._stopping.is_set():
                log.warning("%s: connection error: %s", where, exc)
        except Exception:  # a bug must cost one connection, never the node
            log.exception("%s: internal error; closing the connection", where)
        finally:
            leases.release_all()
            with self._conns_lock:
                self._conns.pop(sock, None)
            sock.close()

    def _conversation(self, sock: wire.Stream, nonce: bytes, where: str, leases: _ConnLeases) -> None:
        authed = self._secret is None
        while True:
            frame = self._read_request(sock)
            # Any frame from the client means it has finished reading the previous reply's regions.
            leases.end_implicit()
            if frame is None:
                return
            kind, raw_header = frame
            if not authed:
                # Whatever went wrong, an unauthenticated peer hears the same thing and is dropped.
                if not self._auth_ok(kind, raw_header, nonce):
                    log.warning("%s: authentication failed; closing the connection", where)
                    self._try_send_error(sock, ErrorCode.AUTH_FAILED, "authentication failed")
                    return
                authed = True
                sock.sendall(wire.encode_frame(wire.HelloOk()))
                assert self._secret is not None and isinstance(sock, socket.socket)
                # frames carry MACs now (and are encrypted under security.encrypt)
                sock = AuthedStream(sock, session_key(self._secret, nonce), server=True, encrypt=self._encrypt)
                continue
            try:
                self._answer(sock, kind, wire.decode_header(kind, raw_header), leases)
            except (FrameError, RequestError) as exc:
                log.warning("%s: refused request: %s", where, exc)
                sock.sendall(wire.encode_frame(wire.ErrorReply(exc.code, str(exc))))

    def _auth_ok(self, kind: int, raw_header: bytes, nonce: bytes) -> bool:
        assert self._secret is not None
        if kind != Kind.HELLO:
            return False
        try:
            hello = wire.decode_header(kind, raw_header)
        except FrameError:
            return False
        return wire.check_mac(self._secret, nonce, hello.mac)

    def _read_request(self, sock: wire.Stream) -> tuple[int, bytes] | None:
        """Next request frame as (kind, raw header); None on a clean close between frames."""
        prefix = bytearray(wire.PREFIX_SIZE)
        view = memoryview(prefix)
        sock.settimeout(None)  # idle persistent connections wait indefinitely for the next request
        first = sock.recv_into(view)
        if first == 0:
            return None
        deadline = time.monotonic() + self._frame_timeout_s
        wire.recv_exact_into(sock, view[first:], deadline)
        head = wire.parse_prefix(prefix, max_payload=0)  # requests never carry a payload
        raw_header = wire.recv_exact(sock, head.header_len, deadline)
        sock.settimeout(self._frame_timeout_s)
        return head.kind, bytes(raw_header)

    def _answer(self, sock: wire.Stream, kind: int, header: object, leases: _ConnLeases) -> None:
        """Answer one request (SHM_DONE is one-way: no answer)."""
        if isinstance(header, wire.PullRequest):
            self._answer_pull(sock, header)
        elif isinstance(header, wire.PullShmRequest):
            self._answer_pull_shm(sock, header, leases)
        elif isinstance(header, wire.ManifestRequest):
            sock.sendall(wire.encode_frame(wire.ManifestReply(self._store.manifest(header.prefix))))
        elif isinstance(header, wire.ShmOfferRequest):
            pool = self._store.pool
            offer = wire.ShmOffer(pool is not None, "" if pool is None else pool.probe_name, b"" if pool is None else pool.token)
            sock.sendall(wire.encode_frame(offer))
        elif isinstance(header, wire.ShmDone):
            leases.end_held(header.leases)
        elif isinstance(header, wire.UcxHello):
            self._answer_ucx_hello(sock, header, leases)
        elif isinstance(header, wire.PullUcxRequest):
            self._answer_pull_ucx(sock, header, leases)
        elif isinstance(header, wire.Hello):
            sock.sendall(wire.encode_frame(wire.HelloOk()))  # harmless: already authenticated or no secret
        elif isinstance(header, msgspec.Struct) and type(header) in self._handlers:
            sock.sendall(_encode_reply(self._handlers[type(header)](header)))
        else:
            raise RequestError(ErrorCode.UNKNOWN_KIND, f"{Kind(kind).name} is not a request this node serves")

    def _answer_pull(self, sock: wire.Stream, request: wire.PullRequest) -> None:
        pieces, lease = self._store.resolve(request.pieces)
        try:
            arrays = [p.array for p in pieces if p.array is not None]
            total = sum(a.nbytes for a in arrays)
            self._check_payload(total)
            infos = [wire.PieceInfo(p.dtype, p.count, self._store.wire_crc(p)) for p in pieces]
            prefix = wire.encode_frame(wire.PullReply(infos), payload_len=total)
            wire.send_buffers(sock, [prefix, *(memoryview(a.view(np.uint8)) for a in arrays)])
        finally:
            lease.release()

    def _answer_pull_shm(self, sock: wire.Stream, request: wire.PullShmRequest, leases: _ConnLeases) -> None:
        if request.hold and len(leases.held) >= _MAX_HELD_LEASES:
            raise RequestError(
                ErrorCode.REPLY_TOO_LARGE, f"{_MAX_HELD_LEASES} zero-copy leases already held; drop pulled arrays first"
            )
        found = self._store.resolve_shm(request.pieces)
        lease = found.lease
        try:
            infos = found.infos
            inline = [p.array for _, p in found.inline if p.array is not None]
            total = sum(a.nbytes for a in inline)
            self._check_payload(total + sum(i.count * _itemsize(i.dtype) for i in infos if i is not None))
            for at, p in found.inline:
                infos[at] = wire.ShmPiece(p.dtype, p.count, self._store.wire_crc(p), -1, 0)
            pool = self._store.pool
            segments = [wire.ShmSegment(*pool.segment(s)) for s in found.segments] if pool is not None else []
            lease_id = leases.next_id() if request.hold and segments else 0
            # every inline piece was described just above: no None is left (no per-pull check on this path)
            complete = cast("list[wire.ShmPiece]", infos)
            prefix = _encode_reply(wire.PullShmReply(segments, complete, lease_id), payload_len=total)
            wire.send_buffers(sock, [prefix, *(memoryview(a.view(np.uint8)) for a in inline)])
        except BaseException:
            lease.release()
            raise
        leases.add(lease, lease_id)

    def _answer_ucx_hello(self, sock: wire.Stream, hello: wire.UcxHello, leases: _ConnLeases) -> None:
        if not self._ucx:
            reason = ("this node encrypts (security.encrypt) and UCX bytes would not be" if self._encrypt
                      else "UCX is turned off on this node" if ucx_transport.ucx_available()
                      else f"no ucxx here ({ucx_transport.ucx_import_error()})")
            sock.sendall(wire.encode_frame(wire.UcxOffer(False, b"", reason)))
            return
        try:
            worker = ucx_transport.process_worker()
            if not ucx_transport.plausible_address(hello.worker_address, worker.address):
                raise StoreError(f"a {len(hello.worker_address)}-byte UCX_HELLO that is not a UCX worker address of this UCX version")
            leases.ucx_endpoint = worker.endpoint(hello.worker_address)
        except StoreError as exc:
            log.warning("shard node %s: UCX endpoint to a peer failed: %s", self.address, exc)
            sock.sendall(wire.encode_frame(wire.UcxOffer(False, b"", str(exc))))
            return
        sock.sendall(wire.encode_frame(wire.UcxOffer(True, worker.address)))

    def _answer_pull_ucx(self, sock: wire.Stream, request: wire.PullUcxRequest, leases: _ConnLeases) -> None:
        if leases.ucx_endpoint is None:
            raise RequestError(ErrorCode.MALFORMED, "PULL_UCX before a UCX_HELLO was accepted on this connection")
        if len(request.pieces) > ucx_transport.MAX_PIECES:
            raise RequestError(ErrorCode.REPLY_TOO_LARGE, f"over {ucx_transport.MAX_PIECES} pieces in one PULL_UCX; split the pull")
        if not 0 <= request.tag <= (1 << 64) - 1 - len(request.pieces):
            raise RequestError(ErrorCode.MALFORMED, f"PULL_UCX tag {request.tag} does not leave room for its pieces in 64 bits")
        pieces, lease = self._store.resolve(request.pieces)
        try:
            total = sum(p.count * _itemsize(p.dtype) for p in pieces)
            self._check_payload(total)
            infos = [wire.PieceInfo(p.dtype, p.count, self._store.wire_crc(p)) for p in pieces]
            sock.sendall(_encode_reply(wire.PullUcxReply(infos, total)))
            deadline = time.monotonic() + self._frame_timeout_s
            ucx_transport.send_pieces(leases.ucx_endpoint, [p.array for p in pieces], request.tag, deadline)
        finally:
            lease.release()

    def _check_payload(self, total: int) -> None:
        if total > self._max_payload:
            raise RequestError(
                ErrorCode.REPLY_TOO_LARGE, f"reply of {total} bytes exceeds max_payload={self._max_payload}; split the pull"
            )

    def _try_send_error(self, sock: wire.Stream, code: ErrorCode, message: str) -> None:
        try:
            sock.settimeout(1.0)
            sock.sendall(wire.encode_frame(wire.ErrorReply(code, message)))
        except OSError:
            pass


_MAX_HELD_LEASES = 1 << 16


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


class _ConnLeases:
    """Shared-memory leases of one connection: the implicit one of the last reply, and held ones."""

    def __init__(self) -> None:
        self.implicit: Lease | None = None
        self.ucx_endpoint: object | None = None  # this connection's UCX endpoint to the client's worker
        self.held: dict[int, Lease] = {}
        self._last_id = 0

    def next_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def add(self, lease: Lease, lease_id: int) -> None:
        if lease_id:
            self.held[lease_id] = lease
        else:
            self.implicit = lease

    def end_implicit(self) -> None:
        if self.implicit is not None:
            self.implicit.release()
            self.implicit = None

    def end_held(self, ids: list[int]) -> None:
        for lease_id in ids:  # unknown ids are ignored: releasing twice must be harmless
            lease = self.held.pop(lease_id, None)
            if lease is not None:
                lease.release()

    def release_all(self) -> None:
        self.end_implicit()
        self.end_held(list(self.held))


def _encode_reply(header: msgspec.Struct, payload_len: int = 0) -> bytes:
    try:
        return wire.encode_frame(header, payload_len)
    except ProtocolError as exc:
        raise RequestError(ErrorCode.REPLY_TOO_LARGE, f"{exc}; ask for fewer pieces per request") from exc
