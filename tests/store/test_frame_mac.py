"""Data-plane frames carry MACs after the handshake (store/frame_mac.py): a man in the middle that
replays an earlier reply of the same connection (valid bytes, valid crc32) or flips a bit is caught by
the client; a node drops a connection whose request fails its tag; without a secret nothing changes."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from earl_stream.errors import StoreError
from earl_stream.store import ShardClient, ShardNode, wire
from earl_stream.store.frame_mac import TAG_BYTES, AuthedStream, session_key

DATA = np.arange(1000, dtype=np.int32)
SECRET = b"cluster-secret-0123456789"


def _frame(sock: socket.socket, tagged: bool) -> bytes:
    prefix = bytes(wire.recv_exact(sock, wire.PREFIX_SIZE, None))
    _m, _v, _k, header_len, payload_len = wire.PREFIX.unpack(prefix)
    rest = bytes(wire.recv_exact(sock, header_len + payload_len + (TAG_BYTES if tagged else 0), None))
    return prefix + rest


class Proxy:
    """Relays one client connection frame by frame; `tamper(n, frame)` may change the node's n-th tagged
    reply (n counts from 0 after HELLO_OK)."""

    def __init__(self, target: str, tamper: Callable[[int, bytes], bytes]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.target, self.tamper = target, tamper
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        host, port = self.target.rsplit(":", 1)
        node = socket.create_connection((host, int(port)))
        threading.Thread(target=self._upstream, args=(client, node), daemon=True).start()
        try:
            client.sendall(_frame(node, False))  # CHALLENGE
            client.sendall(_frame(node, False))  # HELLO_OK
            n = 0
            while True:
                client.sendall(self.tamper(n, _frame(node, True)))
                n += 1
        except OSError:
            client.close()

    def _upstream(self, client: socket.socket, node: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                node.sendall(data)
        except OSError:
            pass
        node.close()


@pytest.fixture
def node() -> Iterator[ShardNode]:
    with ShardNode(secret=SECRET, frame_timeout_s=5.0) as n:
        n.put("k", DATA)
        yield n


def test_frames_round_trip_with_macs(node: ShardNode) -> None:
    with ShardClient(secret=SECRET, transport="tcp", timeout_s=5.0) as client:
        for lo, hi in ((0, 10), (5, 900), (0, 1000)):
            (arr,) = client.pull(node.address, [("k", lo, hi)])
            np.testing.assert_array_equal(arr, DATA[lo:hi])


def test_a_replayed_reply_fails_its_mac(node: ShardNode) -> None:
    first: list[bytes] = []

    def replay(n: int, frame: bytes) -> bytes:
        if n == 0:
            first.append(frame)
            return frame
        return first[0]  # the same pull answered again with the first answer: right bytes, right crc32

    proxy = Proxy(node.address, replay)
    with ShardClient(secret=SECRET, transport="tcp", timeout_s=5.0) as client:
        (arr,) = client.pull(proxy.address, [("k", 0, 100)])
        np.testing.assert_array_equal(arr, DATA[:100])
        with pytest.raises(StoreError, match="failed its MAC"):
            client.pull(proxy.address, [("k", 0, 100)])


def test_a_flipped_bit_fails_its_mac(node: ShardNode) -> None:
    def flip(n: int, frame: bytes) -> bytes:
        out = bytearray(frame)
        out[-TAG_BYTES - 1] ^= 1  # the payload's last byte
        return bytes(out)

    proxy = Proxy(node.address, flip)
    with ShardClient(secret=SECRET, transport="tcp", timeout_s=5.0) as client, \
            pytest.raises(StoreError, match="failed its MAC"):
        client.pull(proxy.address, [("k", 0, 100)])


def test_the_node_drops_a_request_with_a_bad_tag(node: ShardNode) -> None:
    host, port = node.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    challenge = wire.decode_header(wire.Kind.CHALLENGE, _frame(sock, False)[wire.PREFIX_SIZE:])
    sock.sendall(wire.encode_frame(wire.Hello(wire.auth_mac(SECRET, challenge.nonce))))
    _frame(sock, False)  # HELLO_OK
    wrong = AuthedStream(sock, session_key(SECRET, b"another connection's nonce".ljust(32, b"\0")), server=False)
    wrong.sendall(wire.encode_frame(wire.ManifestRequest("")))
    got = b""
    try:
        while chunk := sock.recv(65536):  # the node answers AUTH_FAILED (if anything) and closes
            got += chunk
    except ConnectionResetError:  # it closed with part of our request unread: the kernel resets the connection
        pass
    if got:
        _m, _v, kind, header_len, _p = wire.PREFIX.unpack(got[:wire.PREFIX_SIZE])
        error = wire.decode_header(kind, got[wire.PREFIX_SIZE:wire.PREFIX_SIZE + header_len])
        assert kind == wire.Kind.ERROR and error.code == wire.ErrorCode.AUTH_FAILED
    with ShardClient(secret=SECRET, transport="tcp", timeout_s=5.0) as client:  # the node still serves others
        assert [e.key for e in client.manifest(node.address)] == ["k"]
