"""Bad input over raw sockets never kills a live shard node; a normal client still pulls after each case."""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from earl_stream.store import ErrorCode, ShardClient, ShardNode, wire

DATA = np.arange(1000, dtype=np.int32)


@pytest.fixture
def node() -> Iterator[ShardNode]:
    with ShardNode(frame_timeout_s=5.0) as n:
        n.put("k", DATA)
        yield n


def _connect(address: str) -> tuple[socket.socket, wire.Challenge]:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5.0)
    head, header = _read_frame(sock)
    assert head.kind == wire.Kind.CHALLENGE
    return sock, header


def _read_frame(sock: socket.socket) -> tuple[wire.FramePrefix, object]:
    head = wire.parse_prefix(wire.recv_exact(sock, wire.PREFIX_SIZE, time.monotonic() + 5), 1 << 30)
    header = wire.decode_header(head.kind, wire.recv_exact(sock, head.header_len, time.monotonic() + 5))
    if head.payload_len:
        wire.recv_exact(sock, head.payload_len, time.monotonic() + 5)
    return head, header


def _expect_error(sock: socket.socket, code: ErrorCode) -> str:
    head, header = _read_frame(sock)
    assert head.kind == wire.Kind.ERROR, head
    assert isinstance(header, wire.ErrorReply)
    assert header.code == code, header
    return header.message


def _expect_closed(sock: socket.socket) -> None:
    sock.settimeout(5.0)
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def _raw_frame(kind: int, header: bytes, payload_len: int = 0, *, magic: bytes = wire.MAGIC, version: int = wire.PROTOCOL_VERSION) -> bytes:
    return struct.pack("!4sHHIQ", magic, version, kind, len(header), payload_len) + header


def _pull_header(pieces: list[tuple[str, int, int]]) -> bytes:
    return msgspec.msgpack.encode(wire.PullRequest(pieces))


def _still_serves(node: ShardNode) -> None:
    with ShardClient(timeout_s=5.0) as client:
        (arr,) = client.pull(node.address, [("k", 10, 20)])
    np.testing.assert_array_equal(arr, DATA[10:20])


def _await_log(caplog: pytest.LogCaptureFixture, text: str) -> None:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if any(text in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records):
            return
        time.sleep(0.01)
    raise AssertionError(f"no warning containing {text!r}; got {[r.getMessage() for r in caplog.records]}")


FATAL_CASES = {
    "garbage": (b"\x00\xffGET / HTTP/1.1\r\n\r\n" + bytes(range(256)), ErrorCode.BAD_MAGIC),
    "wrong_magic": (_raw_frame(wire.Kind.PULL, _pull_header([("k", 0, 1)]), magic=b"XSTR"), ErrorCode.BAD_MAGIC),
    "wrong_version": (_raw_frame(wire.Kind.PULL, _pull_header([("k", 0, 1)]), version=99), ErrorCode.UNSUPPORTED_VERSION),
    "oversized_header": (_raw_frame(wire.Kind.PULL, b"")[:8] + struct.pack("!IQ", (1 << 20) + 1, 0), ErrorCode.FRAME_TOO_LARGE),
    "oversized_payload": (_raw_frame(wire.Kind.PULL, b"", payload_len=1 << 62), ErrorCode.FRAME_TOO_LARGE),
    "request_with_payload": (_raw_frame(wire.Kind.PULL, _pull_header([("k", 0, 1)]), payload_len=16), ErrorCode.FRAME_TOO_LARGE),
}


@pytest.mark.parametrize("case", sorted(FATAL_CASES))
def test_fatal_frames_get_error_then_close(node: ShardNode, case: str, caplog: pytest.LogCaptureFixture) -> None:
    data, code = FATAL_CASES[case]
    sock, _ = _connect(node.address)
    with sock:
        sock.sendall(data)
        _expect_error(sock, code)
        _expect_closed(sock)
    _await_log(caplog, "closing the connection")
    _still_serves(node)


REQUEST_ERRORS = {
    "unknown_key": ([("nope", 0, 1)], ErrorCode.UNKNOWN_KEY),
    "out_of_range": ([("k", 990, 1001)], ErrorCode.BAD_RANGE),
    "inverted_range": ([("k", 20, 10)], ErrorCode.BAD_RANGE),
    "negative_start": ([("k", -5, 3)], ErrorCode.BAD_RANGE),
}


@pytest.mark.parametrize("case", sorted(REQUEST_ERRORS))
def test_bad_requests_get_typed_error_and_connection_survives(node: ShardNode, case: str, caplog: pytest.LogCaptureFixture) -> None:
    pieces, code = REQUEST_ERRORS[case]
    sock, _ = _connect(node.address)
    with sock:
        sock.sendall(_raw_frame(wire.Kind.PULL, _pull_header([("k", 0, 2), *pieces])))
        message = _expect_error(sock, code)
        assert "k" in message or "nope" in message
        # The framing is intact, so the same connection keeps working.
        sock.sendall(_raw_frame(wire.Kind.PULL, _pull_header([("k", 0, 2)])))
        head, reply = _read_frame(sock)
        assert head.kind == wire.Kind.PULL_REPLY and head.payload_len == 8
    _await_log(caplog, "refused request")
    _still_serves(node)


@pytest.mark.parametrize(
    "kind, header, code",
    [
        (wire.Kind.PULL, b"\xc1\xc1garbage", ErrorCode.MALFORMED),
        (wire.Kind.PULL, msgspec.msgpack.encode({"pieces": [["k", "zero", 1]]}), ErrorCode.MALFORMED),
        (wire.Kind.PULL, msgspec.msgpack.encode({"pieces": [["k", 0, (1 << 64) - 1]]}), ErrorCode.BAD_RANGE),
        (777, b"\x80", ErrorCode.UNKNOWN_KIND),
        (wire.Kind.PULL_REPLY, msgspec.msgpack.encode(wire.PullReply([])), ErrorCode.UNKNOWN_KIND),
    ],
)
def test_malformed_headers_and_kinds(node: ShardNode, kind: int, header: bytes, code: ErrorCode) -> None:
    sock, _ = _connect(node.address)
    with sock:
        sock.sendall(_raw_frame(kind, header))
        _expect_error(sock, code)
    _still_serves(node)


@pytest.mark.parametrize("cut", [3, wire.PREFIX_SIZE, wire.PREFIX_SIZE + 4])
def test_disconnect_mid_frame(node: ShardNode, cut: int, caplog: pytest.LogCaptureFixture) -> None:
    frame = _raw_frame(wire.Kind.PULL, _pull_header([("k", 0, 100)]))
    sock, _ = _connect(node.address)
    sock.sendall(frame[:cut])
    sock.close()
    _await_log(caplog, "disconnected mid-frame")
    _still_serves(node)


def test_stalled_half_frame_does_not_block_other_clients(node: ShardNode) -> None:
    stalled, _ = _connect(node.address)
    with stalled:
        stalled.sendall(_raw_frame(wire.Kind.PULL, _pull_header([("k", 0, 100)]))[:10])
        _still_serves(node)  # served while the other connection sits mid-frame


def test_client_that_never_reads_its_reply(node: ShardNode) -> None:
    big = np.zeros(8 << 20, dtype=np.uint8)
    node.put("big", big)
    lazy, _ = _connect(node.address)
    with lazy:
        lazy.sendall(_raw_frame(wire.Kind.PULL, _pull_header([("big", 0, big.size)] * 4)))
        _still_serves(node)


def test_reply_larger_than_max_payload_is_refused() -> None:
    with ShardNode(max_payload=1000) as node:
        node.put("k", DATA)
        with ShardClient(timeout_s=5.0) as client:
            with pytest.raises(Exception, match="REPLY_TOO_LARGE"):
                client.pull(node.address, [("k", 0, 1000)])
            (small,) = client.pull(node.address, [("k", 0, 100)])
            assert small.nbytes == 400


# --- authentication ------------------------------------------------------------------------------------


@pytest.fixture
def secure_node() -> Iterator[ShardNode]:
    with ShardNode(secret=b"cluster-secret", frame_timeout_s=5.0) as n:
        n.put("k", DATA)
        yield n


def test_request_without_hello_is_refused_and_closed(secure_node: ShardNode) -> None:
    sock, challenge = _connect(secure_node.address)
    assert challenge.auth_required and len(challenge.nonce) == wire.NONCE_BYTES
    with sock:
        sock.sendall(_raw_frame(wire.Kind.PULL, _pull_header([("k", 0, 10)])))
        assert _expect_error(sock, ErrorCode.AUTH_FAILED) == "authentication failed"
        _expect_closed(sock)


def test_wrong_mac_and_replayed_mac_are_refused(secure_node: ShardNode) -> None:
    sock, challenge = _connect(secure_node.address)
    with sock:
        sock.sendall(wire.encode_frame(wire.Hello(wire.auth_mac(b"wrong", challenge.nonce))))
        assert _expect_error(sock, ErrorCode.AUTH_FAILED) == "authentication failed"
        _expect_closed(sock)
    # A proof is bound to its connection's nonce: replaying a valid one elsewhere fails.
    first, c1 = _connect(secure_node.address)
    second, _ = _connect(secure_node.address)
    with first, second:
        second.sendall(wire.encode_frame(wire.Hello(wire.auth_mac(b"cluster-secret", c1.nonce))))
        _expect_error(second, ErrorCode.AUTH_FAILED)


def test_client_secrets(secure_node: ShardNode) -> None:
    from earl_stream.errors import StoreError

    with ShardClient(timeout_s=5.0) as missing, pytest.raises(StoreError, match="requires the cluster secret"):
        missing.pull(secure_node.address, [("k", 0, 1)])
    with ShardClient(secret=b"nope", timeout_s=5.0) as wrong, pytest.raises(StoreError, match="refused our credentials"):
        wrong.pull(secure_node.address, [("k", 0, 1)])
    with ShardClient(secret=b"cluster-secret", timeout_s=5.0) as right:
        (arr,) = right.pull(secure_node.address, [("k", 5, 9)])
        np.testing.assert_array_equal(arr, DATA[5:9])
        assert [e.key for e in right.manifest(secure_node.address)] == ["k"]
        with right.sibling() as twin:  # a second connection, with the same credentials
            (arr,) = twin.pull(secure_node.address, [("k", 5, 9)])
            np.testing.assert_array_equal(arr, DATA[5:9])
