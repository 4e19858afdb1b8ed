"""The UCX transport (through ucxx) and the choice of transport.

The UCX tests need `ucxx` (the 'ucx' extra; `make test-ucx` runs them in .venv-ucx) and skip cleanly
without it; the remote node runs in its own process (UCX between two processes, the real case). What
every transport must do (UCX included) is tests/store/test_transport_contract.py's.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from node_process import NodeProcess

from earl_stream.errors import StoreError
from earl_stream.store import ShardClient, ShardNode, wire
from earl_stream.store.ucx import TRANSPORTS, check_transport, ucx_available, ucx_import_error

os.environ.setdefault("UCX_TLS", "tcp,sm,self")  # no GPU or RDMA device here
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def test_unknown_transport_is_refused_with_the_known_names() -> None:
    with pytest.raises(StoreError, match="auto, shm, tcp, ucx"):
        ShardClient(transport="rdma")
    assert TRANSPORTS == ("auto", "shm", "tcp", "ucx")


@pytest.mark.skipif(ucx_available(), reason="ucxx is installed here")
def test_asking_for_ucx_without_ucxx_fails_clearly() -> None:
    with pytest.raises(StoreError, match=r"transport 'ucx' was asked for but ucxx does not import"):
        check_transport("ucx")
    with pytest.raises(StoreError, match=r"earl_stream\[ucx\]"):
        ShardClient(transport="ucx")
    assert ucx_import_error() is not None
    with ShardNode(shm=False) as node, ShardClient(timeout_s=5.0, shm=False) as client:  # auto falls back to TCP
        node.put("k", np.arange(10))
        np.testing.assert_array_equal(client.pull(node.address, [("k", 2, 5)])[0], [2, 3, 4])
        assert client.transport(node.address) == "tcp"


@pytest.fixture
def remote_node(tmp_path: Path) -> Iterator[str]:
    """A node in its own process (UCX between two processes, the real case) without shared memory."""
    pytest.importorskip("ucxx")
    with NodeProcess(tmp_path, shm=False, ucx=True) as node:
        yield node.address


@pytest.mark.ucx
def test_transport_choice_per_peer(remote_node: str) -> None:
    with ShardClient(transport="auto", timeout_s=30.0) as client, ShardNode() as local:
        local.put("x", np.arange(4))
        client.pull(remote_node, [("m", 0, 1)])
        client.pull(local.address, [("x", 0, 1)])
        assert client.transport(remote_node) == "ucx"  # that node keeps no shared memory
        assert client.transport(local.address) == "shm"  # same host, shared memory: preferred over UCX
    with ShardClient(transport="shm", timeout_s=30.0) as client:
        client.pull(remote_node, [("m", 0, 1)])
        assert client.transport(remote_node) == "tcp"
    with ShardClient(transport="tcp", timeout_s=30.0) as client:
        client.pull(remote_node, [("m", 0, 1)])
        assert client.transport(remote_node) == "tcp"


@pytest.mark.ucx
def test_ucx_required_but_not_offered_is_an_explicit_error() -> None:
    pytest.importorskip("ucxx")
    with ShardNode(shm=False, ucx=False) as node, ShardClient(transport="ucx", timeout_s=10.0) as client:
        node.put("k", np.arange(4))
        with pytest.raises(StoreError, match="does not offer it: UCX is turned off on this node"):
            client.pull(node.address, [("k", 0, 1)])
    with ShardNode(shm=False, secret=b"s") as node, ShardClient(transport="ucx", secret=b"s", timeout_s=10.0) as client:
        node.put("k", np.arange(4))  # a node whose peers authenticate offers UCX by default
        np.testing.assert_array_equal(client.pull(node.address, [("k", 1, 3)])[0], [1, 2])
        assert client.transport(node.address) == "ucx"
    with ShardNode(shm=False, ucx=False) as node, ShardClient(transport="auto", timeout_s=10.0) as client:
        node.put("k", np.arange(4))
        np.testing.assert_array_equal(client.pull(node.address, [("k", 1, 3)])[0], [1, 2])
        assert client.transport(node.address) == "tcp"  # auto falls back to TCP


def _raw_request(address: str, frame: bytes) -> tuple[int, object]:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        def read() -> tuple[int, object]:
            head = wire.parse_prefix(wire.recv_exact(sock, wire.PREFIX_SIZE, None), 1 << 20)
            return head.kind, wire.decode_header(head.kind, wire.recv_exact(sock, head.header_len, None))

        read()  # CHALLENGE (no secret)
        sock.sendall(frame)
        return read()


def test_bad_ucx_frames_get_typed_answers_and_the_node_keeps_serving() -> None:
    with ShardNode(shm=False, frame_timeout_s=5.0, ucx=True) as node:
        node.put("k", np.arange(10))
        kind, reply = _raw_request(node.address, wire.encode_frame(wire.PullUcxRequest([("k", 0, 3)], 1 << 20)))
        assert kind == wire.Kind.ERROR and reply.code == wire.ErrorCode.MALFORMED  # type: ignore[attr-defined]
        if ucx_available():
            kind, reply = _raw_request(node.address, wire.encode_frame(wire.UcxHello(b"not a worker address")))
            assert kind == wire.Kind.UCX_OFFER_REPLY and not reply.available  # type: ignore[attr-defined]
        with ShardClient(timeout_s=5.0, shm=False) as client:
            np.testing.assert_array_equal(client.pull(node.address, [("k", 0, 3)])[0], [0, 1, 2])
