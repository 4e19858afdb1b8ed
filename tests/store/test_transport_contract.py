"""The contract every `Transport` keeps (store/transport.py), run over each of them against a shard node in
its own process: rows and token ranges come back exact (merged runs and empty ranges included), corrupt
bytes are refused by their checksum and the connection goes on serving, a node killed while pulls from it
run is a clear `StoreError` (never a hang or wrong data), and a node that wants the cluster secret
refuses a client without it or with another one.

tcp and shm run everywhere; ucx needs `ucxx` (the `ucx` extra): `make test-ucx` runs it in .venv-ucx.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from node_process import NodeProcess

from earl_stream.errors import StoreError
from earl_stream.store import ShardClient, cleanup_stale_segments
from earl_stream.store.ucx import ucx_available

os.environ.setdefault("UCX_TLS", "tcp,sm,self")  # no GPU or RDMA device here (the node process inherits it)
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

TRANSPORTS = ["tcp", "shm", pytest.param("ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(
    not ucx_available(), reason="ucxx is not installed (make test-ucx runs this in .venv-ucx)")])]
SECRET = b"contract-secret"


def _node(tmp_path: Path, transport: str, **kw: object) -> NodeProcess:
    return NodeProcess(tmp_path, shm=transport == "shm", ucx=transport == "ucx", **kw)  # type: ignore[arg-type]


def _client(transport: str, secret: bytes | None = SECRET, timeout_s: float = 30.0) -> ShardClient:
    return ShardClient(transport=transport, secret=secret, timeout_s=timeout_s)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rows_and_token_ranges_come_back_exact(tmp_path: Path, transport: str) -> None:
    with _node(tmp_path, transport, secret=SECRET) as node, _client(transport) as client:
        rows = [("k", 0, 10), ("m", 2, 5), ("k", 5, 5), ("k", 100, 3_000_000)]
        a, m, empty, big = client.pull(node.address, rows)
        assert client.transport(node.address) == transport
        np.testing.assert_array_equal(a, np.arange(10))
        np.testing.assert_array_equal(m, [2, 3, 4])
        assert m.dtype == np.uint8 and empty.size == 0 and empty.dtype == np.int32
        np.testing.assert_array_equal(big, np.arange(100, 3_000_000))
        (merged,) = client.pull(node.address, [("k", 0, 3), ("k", 10, 12)], merge_runs=True)
        np.testing.assert_array_equal(merged, [0, 1, 2, 10, 11])
        # a token range of one row, then several ranges of one key: what a sequence-parallel rank pulls
        got = client.pull_many({node.address: [("k", 1_000, 1_512), ("k", 2_000_000, 2_000_512)]})[node.address]
        np.testing.assert_array_equal(np.concatenate(got), np.r_[1_000:1_512, 2_000_000:2_000_512])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupt_bytes_are_refused_and_the_connection_serves_on(tmp_path: Path, transport: str) -> None:
    with _node(tmp_path, transport, secret=SECRET) as node, _client(transport) as client:
        np.testing.assert_array_equal(client.pull(node.address, [("m", 0, 2)])[0], [0, 1])
        with pytest.raises(StoreError, match="checksum mismatch"):
            client.pull(node.address, [("bad", 0, 1000)])
        np.testing.assert_array_equal(client.pull(node.address, [("m", 3, 6)])[0], [3, 4, 5])
        assert client.transport(node.address) == transport


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_node_killed_while_pulls_run_is_a_clear_error(tmp_path: Path, transport: str) -> None:
    """Pulls of 64 MiB run back to back while the node is killed (-9): every pull that returned is exact,
    the one in flight and the next fail with a StoreError naming the peer, within the client's timeout."""
    outcome: dict[str, object] = {"done": 0}
    with _node(tmp_path, transport, secret=SECRET, big_mib=64) as node, _client(transport, timeout_s=20.0) as client:
        def pull_until_it_fails() -> None:
            try:
                while True:
                    (got,) = client.pull(node.address, [("big", 0, 64 << 20)])
                    assert got.size == 64 << 20 and got[0] == 7 and got[-1] == 7 and int(got.sum()) == 7 * (64 << 20)
                    outcome["done"] = int(outcome["done"]) + 1  # type: ignore[call-overload]
            except StoreError as exc:
                outcome["error"] = exc

        puller = threading.Thread(target=pull_until_it_fails, daemon=True)
        puller.start()
        deadline = time.monotonic() + 60
        while outcome["done"] == 0 and puller.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outcome["done"], f"no pull finished before the kill: {outcome}"
        node.kill()
        puller.join(30)
        assert not puller.is_alive(), "a pull from a killed node hung"
        assert isinstance(outcome.get("error"), StoreError), outcome
        assert node.address in str(outcome["error"])
        with pytest.raises(StoreError, match=node.address):
            client.pull(node.address, [("m", 0, 1)])
    cleanup_stale_segments()  # what the killed node left in /dev/shm


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_node_with_a_secret_refuses_clients_without_it(tmp_path: Path, transport: str) -> None:
    with _node(tmp_path, transport, secret=SECRET) as node:
        with _client(transport, secret=None, timeout_s=10.0) as client, pytest.raises(StoreError, match="requires the cluster secret"):
            client.pull(node.address, [("m", 0, 1)])
        with _client(transport, secret=b"another", timeout_s=10.0) as client, pytest.raises(StoreError, match="refused our credentials"):
            client.pull(node.address, [("m", 0, 1)])
        with _client(transport) as client:
            np.testing.assert_array_equal(client.pull(node.address, [("m", 5, 7)])[0], [5, 6])
            assert client.transport(node.address) == transport
