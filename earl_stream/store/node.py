"""The shard node: holds a process's tensor shards and serves pulls of them over TCP.

Owns the in-process shard storage (`_ShardStore`: immutable 1-D arrays by key, byte accounting and
back-pressure) and the TCP server that answers PULL / MANIFEST requests (`ShardNode`, one thread per
connection). Framing is `wire.py`'s; what a key means (samples, weights) is `experience.py`'s and
`weights.py`'s. Ownership: `put` takes the caller's array without copying; from then on the node
owns it and the caller must not write to it. Bytes are freed when the key is dropped.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from earl_stream.errors import StoreError
from earl_stream.store import wire
from earl_stream.store.wire import ErrorCode, FrameError, Kind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Shard:
    array: np.ndarray  # 1-D, C-contiguous, read-only
    crc32: int  # of the whole array's bytes, computed once at put


class _RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _ShardStore:
    """Thread-safe key -> immutable array map with byte accounting and optional capacity."""

    def __init__(self, max_bytes: int | None, put_timeout_s: float) -> None:
        self._shards: dict[str, _Shard] = {}
        self._held = 0
        self._max_bytes = max_bytes
        self._put_timeout_s = put_timeout_s
        self._closed = False
        self._cond = threading.Condition()

    @property
    def bytes_held(self) -> int:
        return self._held

    def put_many(self, items: Mapping[str, np.ndarray]) -> None:
        shards = {key: _prepare(key, arr) for key, arr in items.items()}
        need = sum(s.array.nbytes for s in shards.values())
        with self._cond:
            self._refuse_existing(shards)
            if self._max_bytes is not None and need > 0:
                if need > self._max_bytes:
                    raise StoreError(f"{need} bytes can never fit in a node capped at max_bytes={self._max_bytes}")
                fits = self._cond.wait_for(
                    lambda: self._closed or self._held + need <= self._max_bytes, timeout=self._put_timeout_s
                )
                if not fits:
                    raise StoreError(
                        f"back-pressure: node holds {self._held} of max_bytes={self._max_bytes}; {need} more bytes "
                        f"did not fit within {self._put_timeout_s}s. Consumers must release (drop) pulled shards."
                    )
                self._refuse_existing(shards)  # someone may have put the same key while we waited
            if self._closed:
                raise StoreError("shard node is closed")
            self._shards.update(shards)
            self._held += need

    def _refuse_existing(self, shards: Mapping[str, _Shard]) -> None:
        dup = [k for k in shards if k in self._shards]
        if dup:
            raise StoreError(f"keys are immutable once put; already held: {dup[:5]}{' ...' if len(dup) > 5 else ''}")

    def drop(self, keys: Iterable[str]) -> int:
        with self._cond:
            freed = 0
            for key in keys:
                shard = self._shards.pop(key, None)
                if shard is not None:
                    freed += shard.array.nbytes
            self._held -= freed
            self._cond.notify_all()
        return freed

    def drop_prefix(self, prefix: str) -> int:
        with self._cond:
            keys = [k for k in self._shards if k.startswith(prefix)]
        return self.drop(keys)

    def keys(self) -> list[str]:
        with self._cond:
            return list(self._shards)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def resolve(self, pieces: Sequence[tuple[str, int, int]]) -> list[tuple[np.ndarray, int]]:
        """Validate pieces and return (uint8 view of the slice, crc32) per piece."""
        with self._cond:
            shards = [self._shards.get(key) for key, _, _ in pieces]
        out = []
        for (key, start, end), shard in zip(pieces, shards):
            if shard is None:
                raise _RequestError(ErrorCode.UNKNOWN_KEY, f"no shard under key {key!r}")
            n = shard.array.shape[0]
            if not 0 <= start <= end <= n:
                raise _RequestError(ErrorCode.BAD_RANGE, f"range [{start}, {end}) outside [0, {n}] of key {key!r}")
            view = shard.array[start:end].view(np.uint8)
            # Whole-array pulls reuse the crc taken at put: it then also catches corruption at rest.
            crc = shard.crc32 if (start, end) == (0, n) else zlib.crc32(view)
            out.append((shard.array[start:end], crc))
        return out

    def manifest(self, prefix: str) -> list[wire.ManifestEntry]:
        with self._cond:
            items = [(k, s) for k, s in self._shards.items() if k.startswith(prefix)]
        return [wire.ManifestEntry(k, s.array.dtype.str, [int(s.array.shape[0])]) for k, s in sorted(items)]

    def corrupt_for_test(self, key: str, byte_index: int) -> None:
        with self._cond:
            shard = self._shards[key]
            raw = shard.array.view(np.uint8).copy()
            raw[byte_index] ^= 0xFF
            broken = raw.view(shard.array.dtype)
            broken.flags.writeable = False
            self._shards[key] = _Shard(broken, shard.crc32)  # keep the old crc: models bit rot at rest


def _prepare(key: str, arr: np.ndarray) -> _Shard:
    if not isinstance(key, str) or not key:
        raise StoreError(f"shard keys are non-empty strings, got {key!r}")
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise StoreError(f"shard {key!r} must be a 1-D numpy array, got {type(arr).__name__} {getattr(arr, 'shape', '')}")
    if arr.dtype.kind not in wire.STORABLE_KINDS or arr.dtype.hasobject:
        raise StoreError(f"shard {key!r} has dtype {arr.dtype}; only fixed-size numeric dtypes can be stored")
    view = np.ascontiguousarray(arr).view()
    view.flags.writeable = False
    return _Shard(view, zlib.crc32(view.view(np.uint8)))


class ShardNode:
    """Holds tensor shards of this process and serves them to pulling peers.

    `host`/`port`: where to listen (port 0 picks a free one); `secret`: if set, peers must prove it
    (HMAC) before any request; `max_bytes`: capacity, `put` blocks up to `put_timeout_s` for room;
    `max_payload`: largest reply in bytes; `frame_timeout_s`: how long a started frame may take to
    arrive (or a reply to drain); `advertise_host`: host part of `.address` when listening on 0.0.0.0.
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
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise StoreError(f"max_bytes must be positive or None, got {max_bytes}")
        self._store = _ShardStore(max_bytes, put_timeout_s)
        self._secret = secret
        self._max_payload = max_payload
        self._frame_timeout_s = frame_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
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

    def keys(self) -> list[str]:
        return self._store.keys()

    def _corrupt_for_test(self, key: str, byte_index: int = 0) -> None:
        """Test hook: flip one stored byte of `key` without updating its checksum."""
        self._store.corrupt_for_test(key, byte_index)

    # --- server --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, close every connection and join the server threads."""
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
        try:
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._frame_timeout_s)
            nonce = os.urandom(wire.NONCE_BYTES)
            sock.sendall(wire.encode_frame(wire.Challenge(nonce, self._secret is not None)))
            self._conversation(sock, nonce, where)
        except FrameError as exc:
            log.warning("%s: %s; closing the connection", where, exc)
            self._try_send_error(sock, exc.code, str(exc))
        except wire.PeerClosed as exc:
            if not self._stopping.is_set():
                log.warning("%s: disconnected mid-frame (%s)", where, exc)
        except socket.timeout:
            log.warning("%s: frame or reply stalled for over %.0fs; closing the connection", where, self._frame_timeout_s)
        except OSError as exc:
            if not self._stopping.is_set():
                log.warning("%s: connection error: %s", where, exc)
        except Exception:  # a bug must cost one connection, never the node
            log.exception("%s: internal error; closing the connection", where)
        finally:
            with self._conns_lock:
                self._conns.pop(sock, None)
            sock.close()

    def _conversation(self, sock: socket.socket, nonce: bytes, where: str) -> None:
        authed = self._secret is None
        while True:
            frame = self._read_request(sock)
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
                continue
            try:
                self._answer(sock, kind, wire.decode_header(kind, raw_header))
            except (FrameError, _RequestError) as exc:
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

    def _read_request(self, sock: socket.socket) -> tuple[int, bytes] | None:
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

    def _answer(self, sock: socket.socket, kind: int, header: object) -> None:
        if isinstance(header, wire.PullRequest):
            self._answer_pull(sock, header)
        elif isinstance(header, wire.ManifestRequest):
            sock.sendall(wire.encode_frame(wire.ManifestReply(self._store.manifest(header.prefix))))
        elif isinstance(header, wire.Hello):
            sock.sendall(wire.encode_frame(wire.HelloOk()))  # harmless: already authenticated or no secret
        else:
            raise _RequestError(ErrorCode.UNKNOWN_KIND, f"{Kind(kind).name} is not a request")

    def _answer_pull(self, sock: socket.socket, request: wire.PullRequest) -> None:
        resolved = self._store.resolve(request.pieces)
        total = sum(arr.nbytes for arr, _ in resolved)
        if total > self._max_payload:
            raise _RequestError(
                ErrorCode.REPLY_TOO_LARGE, f"reply of {total} bytes exceeds max_payload={self._max_payload}; split the pull"
            )
        infos = [wire.PieceInfo(arr.dtype.str, int(arr.shape[0]), crc) for arr, crc in resolved]
        prefix = wire.encode_frame(wire.PullReply(infos), payload_len=total)
        wire.send_buffers(sock, [prefix, *(memoryview(arr.view(np.uint8)) for arr, _ in resolved)])

    def _try_send_error(self, sock: socket.socket, code: ErrorCode, message: str) -> None:
        try:
            sock.settimeout(1.0)
            sock.sendall(wire.encode_frame(wire.ErrorReply(code, message)))
        except OSError:
            pass
