"""Shard node + client + experience records: real servers on 127.0.0.1 (threads and a child process)."""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from earl_stream.errors import StoreError
from earl_stream.records import TOKEN_FIELDS, SampleRecord
from earl_stream.store import (
    ExperienceWriter,
    Layout,
    PeerUnreachable,
    RemoteError,
    SampleMeta,
    SamplesUnavailable,
    ShardClient,
    ShardNode,
    partition,
    pull_samples,
    sample_key,
)

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
FIELDS = list(TOKEN_FIELDS)


def make_records(prefix: str, n: int, seed: int) -> list[SampleRecord]:
    """Deterministic records (the child process builds the same ones from the same arguments)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(1, 300))
        prompt = int(rng.integers(0, t + 1))
        mask = np.zeros(t, np.uint8)
        mask[prompt:] = 1
        version = np.where(mask == 1, rng.integers(3, 6), -1).astype(np.int32)
        out.append(
            SampleRecord(
                sample_id=f"{prefix}-{i}",
                prompt_ordinal=i // 2,
                episode_id=f"ep-{prefix}-{i}",
                group_id=f"g-{i // 2}",
                env="tictactoe",
                turns=int(rng.integers(1, 5)),
                prompt_tokens=prompt,
                input_ids=rng.integers(0, 512, t).astype(np.int32),
                loss_mask=mask,
                behaviour_logprobs=(-rng.random(t, dtype=np.float32)) * mask,
                policy_version=version,
                reward=float(rng.random()),
                info={"winner": i % 3},
            )
        )
    return out


@pytest.fixture
def node() -> Iterator[ShardNode]:
    with ShardNode() as n:
        yield n


@pytest.fixture
def client() -> Iterator[ShardClient]:
    with ShardClient(timeout_s=10.0) as c:
        yield c


def test_records_round_trip_full_rows_and_subranges(node: ShardNode, client: ShardClient) -> None:
    records = make_records("a", 12, seed=1)
    metas = ExperienceWriter(node, "rollout-0").put(records)
    assert [m.sample_id for m in metas] == [r.sample_id for r in records]
    m0, r0 = metas[0], records[0]
    assert (m0.total_tokens, m0.prompt_tokens, m0.response_tokens) == (r0.num_tokens, r0.prompt_tokens, r0.response_tokens)
    assert m0.producer_address == node.address and m0.advantage is None and m0.info_json == '{"winner":0}'
    assert m0.policy_version_min >= 3 or m0.response_tokens == 0
    rows = pull_samples(client, metas, FIELDS)
    for rec, row in zip(records, rows):
        for name in FIELDS:
            np.testing.assert_array_equal(row[name], getattr(rec, name))
            assert row[name].dtype == TOKEN_FIELDS[name]
    # Sub-ranges as a context-parallel rank would ask for them: two zig-zag chunks per row.
    lengths = [m.total_tokens for m in metas]
    part = partition(lengths, Layout(dp_size=2, dp_rank=1, cp_size=2, cp_rank=1))
    chosen = [metas[i] for i in part.rows]
    pieces = pull_samples(client, chosen, ["input_ids", "loss_mask"], part.ranges_by_position())
    for row, got in zip(part.rows, pieces):
        want = np.concatenate([records[row].input_ids[s:e] for s, e in part.token_ranges[row]])
        np.testing.assert_array_equal(got["input_ids"], want)


def test_put_is_immutable_atomic_and_accounted(node: ShardNode) -> None:
    node.put("x", np.arange(10, dtype=np.float64))
    with pytest.raises(StoreError, match="immutable"):
        node.put("x", np.arange(3, dtype=np.float64))
    with pytest.raises(StoreError, match="immutable"):
        node.put_many({"y": np.zeros(4, np.int8), "x": np.zeros(4, np.int8)})
    assert node.keys() == ["x"] and node.bytes_held == 80  # the failed put_many left nothing behind
    with pytest.raises(StoreError, match="1-D"):
        node.put("m", np.zeros((2, 2)))
    with pytest.raises(StoreError, match="dtype"):
        node.put("o", np.array([object()], dtype=object))
    node.put("strided", np.arange(20, dtype=np.int16)[::2])  # copied to a contiguous array
    assert node.drop(["x", "nope"]) == 80
    assert node.drop_prefix("str") == 20 and node.bytes_held == 0


def test_writer_free_and_held_ids(node: ShardNode) -> None:
    writer = ExperienceWriter(node, "p")
    metas = writer.put(make_records("f", 3, seed=2))
    assert writer.held_sample_ids() == ["f-0", "f-1", "f-2"]
    assert writer.free(["f-1"]) > 0
    assert writer.held_sample_ids() == ["f-0", "f-2"]
    assert not any(k.startswith("s/f-1/") for k in node.keys())
    with ShardClient(timeout_s=5.0) as client, pytest.raises(SamplesUnavailable) as info:
        pull_samples(client, metas, FIELDS)
    assert info.value.sample_ids == ["f-1"] and info.value.partial[0] is not None


def test_corruption_at_rest_is_detected(node: ShardNode, client: ShardClient) -> None:
    metas = ExperienceWriter(node, "p").put(make_records("c", 2, seed=3))
    node._corrupt_for_test(sample_key("c-1", "input_ids"), byte_index=1)
    with pytest.raises(StoreError, match="checksum mismatch"):
        pull_samples(client, metas, FIELDS)
    # The full-row check against the metadata catches what the wire check cannot (bad metadata or
    # bytes damaged before they were put).
    wrong = msgspec.structs.replace(metas[0], checksum=metas[0].checksum ^ 1)
    with pytest.raises(StoreError, match="does not match its metadata"):
        pull_samples(client, [wrong], FIELDS)
    assert pull_samples(client, metas[:1], FIELDS)[0]["loss_mask"].size == metas[0].total_tokens


def test_back_pressure_blocks_until_drop_then_times_out() -> None:
    with ShardNode(max_bytes=1000, put_timeout_s=0.3) as node:
        node.put("a", np.zeros(800, np.uint8))
        with pytest.raises(StoreError, match="never fit"):
            node.put("huge", np.zeros(1001, np.uint8))
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="back-pressure"):
            node.put("b", np.zeros(400, np.uint8))
        assert time.monotonic() - t0 >= 0.25
        threading.Timer(0.1, node.drop, args=(["a"],)).start()
        node.put("b", np.zeros(400, np.uint8))  # blocks until the drop makes room
        assert node.keys() == ["b"] and node.bytes_held == 400


def test_many_clients_at_once(node: ShardNode) -> None:
    data = np.arange(100_000, dtype=np.int64)
    node.put("d", data)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            with ShardClient(timeout_s=10.0) as c:
                for _ in range(20):
                    s = int(rng.integers(0, data.size))
                    e = int(rng.integers(s, data.size + 1))
                    (got,) = c.pull(node.address, [("d", s, e)])
                    np.testing.assert_array_equal(got, data[s:e])
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_shared_client_across_threads_and_peers(client: ShardClient) -> None:
    with ShardNode() as n1, ShardNode() as n2:
        n1.put("a", np.arange(10, dtype=np.int32))
        n2.put("b", np.arange(5, dtype=np.float32))
        for _ in range(3):
            got = client.pull_many({n1.address: [("a", 2, 4)], n2.address: [("b", 0, 5), ("b", 1, 2)]})
            np.testing.assert_array_equal(got[n1.address][0], [2, 3])
            np.testing.assert_array_equal(got[n2.address][1], [1.0])
        with pytest.raises(RemoteError) as info:
            client.pull_many({n1.address: [("zzz", 0, 1)], n2.address: [("b", 0, 1)]})
        assert info.value.code.name == "UNKNOWN_KEY"


def test_reconnects_once_when_a_cached_connection_went_stale(client: ShardClient) -> None:
    node = ShardNode()
    node.put("k", np.arange(4, dtype=np.int32))
    address = node.address
    client.pull(address, [("k", 0, 4)])
    node.close()
    port = int(address.rsplit(":", 1)[1])
    with ShardNode(port=port) as again:
        again.put("k", np.arange(4, dtype=np.int32) * 2)
        (got,) = client.pull(address, [("k", 0, 4)])
        np.testing.assert_array_equal(got, [0, 2, 4, 6])


def test_timeout_and_unreachable_name_the_peer() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (via the backlog) but never speaks
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    with silent, ShardClient(timeout_s=0.3) as client:
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match=f"timed out after 0.3s waiting for .* {address}"):
            client.pull(address, [("k", 0, 1)])
        assert time.monotonic() - t0 < 2.0
    with ShardClient(timeout_s=2.0) as client, pytest.raises(PeerUnreachable, match="cannot connect"):
        client.pull(address, [("k", 0, 1)])


def test_timeout_while_awaiting_a_reply_names_the_request() -> None:
    """A peer that completes the handshake and then never answers."""
    from earl_stream.store import wire

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def mute_server() -> None:
        conn, _ = listener.accept()
        conn.sendall(wire.encode_frame(wire.Challenge(b"n" * wire.NONCE_BYTES, False)))
        held.append(conn)  # read nothing, answer nothing

    thread = threading.Thread(target=mute_server)
    thread.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    # shm=False: with shared memory the offer exchange is part of the handshake, and the mute peer
    # would time out there instead (test_shm covers that).
    with listener, ShardClient(timeout_s=0.3, shm=False) as client:
        with pytest.raises(PeerUnreachable, match=f"0.3s waiting for a reply to PULL of 2 piece.* from peer {address}"):
            client.pull(address, [("k", 0, 1), ("j", 0, 1)])
    thread.join()
    for conn in held:
        conn.close()


def test_ipv6_loopback(client: ShardClient) -> None:
    try:
        node = ShardNode("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with node:
        node.put("k", np.arange(3, dtype=np.int16))
        assert node.address.startswith("[::1]:")
        np.testing.assert_array_equal(client.pull(node.address, [("k", 0, 3)])[0], [0, 1, 2])


# --- a producer in another process ---------------------------------------------------------------------


class _ProducerReady(msgspec.Struct):
    address: str
    metas: list[SampleMeta]


def _start_producer(prefix: str, n: int, seed: int) -> tuple[subprocess.Popen, _ProducerReady]:
    """A child process with its own shard node holding `make_records(prefix, n, seed)`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, __file__, prefix, str(n), str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    if not ready:
        proc.kill()
        raise AssertionError("producer process did not start within 30 s")
    return proc, msgspec.json.decode(proc.stdout.readline(), type=_ProducerReady)


def test_killed_producer_reports_its_samples_lost(node: ShardNode, client: ShardClient) -> None:
    proc, ready = _start_producer("r", 6, seed=7)
    remote = ready.metas
    try:
        local = ExperienceWriter(node, "local").put(make_records("l", 3, seed=8))
        metas = [remote[0], local[0], remote[1], local[1]]
        rows = pull_samples(client, metas, FIELDS)
        np.testing.assert_array_equal(rows[0]["input_ids"], make_records("r", 6, seed=7)[0].input_ids)
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(SamplesUnavailable) as info:
        pull_samples(client, metas, FIELDS)
    err = info.value
    assert err.sample_ids == ["r-0", "r-1"]
    assert isinstance(err, StoreError) and remote[0].producer_address in str(err)
    assert err.partial[0] is None and err.partial[1] is not None
    np.testing.assert_array_equal(err.partial[3]["loss_mask"], make_records("l", 3, seed=8)[1].loss_mask)


def test_pull_64_mib_between_processes(client: ShardClient) -> None:
    proc, ready = _start_producer("big", 0, seed=0)  # the child also holds a 64 MiB float32 "bulk" array
    try:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            (arr,) = client.pull(ready.address, [("bulk", 0, 16 << 20)])
            best = min(best, time.perf_counter() - t0)
        assert arr.nbytes == 64 << 20 and arr[12345] == np.float32(12345 % 1000)
        log.warning("pulled 64 MiB between processes over loopback: best %.2f GiB/s", 1 / 16 / best)
    finally:
        proc.kill()
        proc.wait()


def _producer_main(prefix: str, n: int, seed: int) -> None:
    node = ShardNode()
    metas = ExperienceWriter(node, f"producer-{prefix}").put(make_records(prefix, n, seed))
    node.put("bulk", (np.arange(16 << 20) % 1000).astype(np.float32))
    sys.stdout.buffer.write(msgspec.json.encode(_ProducerReady(node.address, metas)) + b"\n")
    sys.stdout.flush()
    sys.stdin.read()  # serve until the parent closes stdin or kills us
    node.close()


if __name__ == "__main__":
    _producer_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
