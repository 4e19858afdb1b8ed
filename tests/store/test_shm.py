"""Shared-memory transport: transport choice, pool and leases, cleanup, failures, and bad input."""

from __future__ import annotations

import os
import signal
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
    ErrorCode,
    ExperienceWriter,
    Layout,
    PeerUnreachable,
    RemoteError,
    SampleMeta,
    SamplesUnavailable,
    ShardClient,
    ShardNode,
    cleanup_stale_segments,
    partition,
    pull_samples,
    shm_supported,
    wire,
)
from earl_stream.store.shm import SHM_DIR, ShmPool

pytestmark = pytest.mark.skipif(not shm_supported(), reason="needs a writable /dev/shm")
FIELDS = list(TOKEN_FIELDS)


def _records(prefix: str, n: int, seed: int) -> list[SampleRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(1, 3000))
        mask = (np.arange(t) >= t // 3).astype(np.uint8)
        out.append(
            SampleRecord(
                sample_id=f"{prefix}-{i}", prompt_ordinal=i, episode_id=f"e-{prefix}-{i}", group_id=f"g-{i // 2}",
                env="test", turns=1, prompt_tokens=t // 3, input_ids=rng.integers(0, 512, t).astype(np.int32),
                loss_mask=mask, behaviour_logprobs=(-rng.random(t, dtype=np.float32)) * mask,
                policy_version=np.where(mask == 1, 3, -1).astype(np.int32), reward=float(rng.random()), info={},
            )
        )
    return out


@pytest.fixture
def client() -> Iterator[ShardClient]:
    with ShardClient(timeout_s=10.0) as c:
        yield c


@pytest.mark.parametrize("node_shm, client_shm, expect", [(True, True, "shm"), (True, False, "tcp"), (False, True, "tcp")])
def test_transport_is_chosen_per_peer_and_data_is_identical(node_shm: bool, client_shm: bool, expect: str) -> None:
    with ShardNode(shm=node_shm) as node, ShardClient(timeout_s=10.0, shm=client_shm) as client:
        records = _records("t", 10, seed=4)
        metas = ExperienceWriter(node, "p").put(records)
        assert bool(node.shm_segment_names()) == node_shm
        rows = pull_samples(client, metas, FIELDS)  # whole rows: checked against the metadata checksum too
        assert client.transport(node.address) == expect
        for rec, row in zip(records, rows):
            for name in FIELDS:
                np.testing.assert_array_equal(row[name], getattr(rec, name))
        part = partition([m.total_tokens for m in metas], Layout(dp_size=2, dp_rank=0, cp_size=2, cp_rank=1))
        got = pull_samples(client, [metas[i] for i in part.rows], ["input_ids", "behaviour_logprobs"], part.ranges_by_position())
        for row, data in zip(part.rows, got):
            want = np.concatenate([records[row].behaviour_logprobs[s:e] for s, e in part.token_ranges[row]])
            np.testing.assert_array_equal(data["behaviour_logprobs"], want)


def test_arrays_too_big_for_a_segment_travel_inline_in_the_same_reply(client: ShardClient) -> None:
    with ShardNode(shm_segment_bytes=2 << 20) as node:
        big = np.arange(3 << 20, dtype=np.uint8)  # 3 MiB: larger than a segment, stays in private memory
        small = np.arange(1000, dtype=np.float64)
        node.put_many({"big": big, "small": small})
        got = client.pull(node.address, [("small", 0, 1000), ("big", 5, 3 << 20), ("small", 10, 20)])
        assert client.transport(node.address) == "shm"
        np.testing.assert_array_equal(got[0], small)
        np.testing.assert_array_equal(got[1], big[5:])
        np.testing.assert_array_equal(got[2], small[10:20])


def test_pool_allocator_coalesces_and_reuses() -> None:
    pool = ShmPool(max_bytes=8 << 20, segment_bytes=2 << 20, first_segment_bytes=2 << 20)
    try:
        regions = [pool.alloc(100_000) for _ in range(10)]
        assert all(r is not None for r in regions) and pool.reserved_bytes == 2 << 20
        offsets = [r.offset for r in regions]  # type: ignore[union-attr]
        assert offsets == sorted(offsets) and all(o % 64 == 0 for o in offsets)
        for r in regions[1::2] + regions[0::2]:  # free out of order: neighbours must merge
            pool.release(r)  # type: ignore[arg-type]
        assert pool.used_bytes == 0
        whole = pool.alloc(2 << 20)  # only possible if the free list is one extent again
        assert whole is not None and whole.segment == 0 and whole.offset == 0
        assert pool.alloc(3 << 20) is None  # larger than any segment: caller keeps it private
        more = [pool.alloc(2 << 20) for _ in range(4)]
        assert [m is not None for m in more] == [True, True, True, False]  # capped at 8 MiB
    finally:
        pool.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(pool.probe_name.rsplit("-", 1)[0])]


def _raw(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5.0)
    _read(sock)  # CHALLENGE
    return sock


def _read(sock: socket.socket) -> tuple[wire.FramePrefix, object]:
    deadline = time.monotonic() + 5
    head = wire.parse_prefix(wire.recv_exact(sock, wire.PREFIX_SIZE, deadline), 1 << 30)
    header = wire.decode_header(head.kind, wire.recv_exact(sock, head.header_len, deadline))
    if head.payload_len:
        wire.recv_exact(sock, head.payload_len, deadline)
    return head, header


def test_a_leased_region_is_not_reused_until_the_reader_is_done() -> None:
    with ShardNode() as node:
        old = np.full(4096, 7, np.int64)
        node.put("old", old)
        sock = _raw(node.address)
        with sock:
            sock.sendall(wire.encode_frame(wire.PullShmRequest([("old", 0, 4096)])))
            _, reply = _read(sock)
            assert isinstance(reply, wire.PullShmReply)
            loc = reply.pieces[0]
            seg = np.memmap(os.path.join(SHM_DIR, reply.segments[0].name), np.uint8, "r")
            node.drop(["old"])  # the producer frees it while we still read it ...
            node.put("new", np.full(4096, 9, np.int64))  # ... and puts something of the same size
            view = seg[loc.offset : loc.offset + old.nbytes].view(np.int64)
            np.testing.assert_array_equal(view, old)  # still ours: the region is leased
            assert loc.check == wire.sum64(old.view(np.uint8))
            sock.sendall(wire.encode_frame(wire.ShmDone()))
            sock.sendall(wire.encode_frame(wire.ManifestRequest("")))  # SHM_DONE has no reply; this one does
            _read(sock)
        node.put("newer", np.full(4096, 11, np.int64))  # the lease ended: the region is reused now
        assert (seg[loc.offset : loc.offset + old.nbytes].view(np.int64) == 11).all()
        del seg


def test_a_shard_becomes_visible_only_once_complete() -> None:
    """Pulls racing a writer see a key either not at all or whole (it is published after its copy)."""
    with ShardNode() as node, ShardClient(timeout_s=5.0) as client:
        n, keys = 1 << 18, 24
        writer = threading.Thread(target=lambda: [node.put(f"k{i}", np.full(n, i, np.int32)) for i in range(keys)])
        writer.start()
        seen: set[int] = set()
        while len(seen) < keys:
            for i in sorted(set(range(keys)) - seen):
                try:
                    (got,) = client.pull(node.address, [(f"k{i}", 0, n)])
                except RemoteError as exc:
                    assert exc.code == ErrorCode.UNKNOWN_KEY
                    continue
                assert got.shape == (n,) and (got == i).all()
                seen.add(i)
        writer.join()


def test_node_close_unlinks_its_segments() -> None:
    node = ShardNode()
    node.put("k", np.arange(1000))
    names = node.shm_segment_names()
    assert len(names) == 2 and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)  # probe + one segment
    node.close()
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)


_CHILD = """
import sys, msgspec
from earl_stream.store import ExperienceWriter, ShardNode
sys.path.insert(0, sys.argv[1])
from test_shm import _records
node = ShardNode()
metas = ExperienceWriter(node, "child").put(_records("k", 4, seed=11))
sys.stdout.buffer.write(msgspec.json.encode([metas, node.shm_segment_names()]) + b"\\n")
sys.stdout.flush()
sys.stdin.read()
"""


def test_sigkilled_producer_loses_exactly_its_samples_and_its_segments_are_cleaned(client: ShardClient) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(Path(__file__).parent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        remote, names = msgspec.json.decode(proc.stdout.readline(), type=tuple[list[SampleMeta], list[str]])
        with ShardNode() as local:
            local_metas = ExperienceWriter(local, "local").put(_records("l", 2, seed=12))
            metas = [remote[0], local_metas[0], remote[2], local_metas[1]]
            rows = pull_samples(client, metas, FIELDS)
            np.testing.assert_array_equal(rows[2]["input_ids"], _records("k", 4, seed=11)[2].input_ids)
            assert client.transport(remote[0].producer_address) == "shm"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            with pytest.raises(SamplesUnavailable) as info:
                pull_samples(client, metas, FIELDS)
            assert info.value.sample_ids == ["k-0", "k-2"]
            assert info.value.partial[1] is not None and info.value.partial[3] is not None
        paths = [os.path.join(SHM_DIR, n) for n in names]
        assert len(paths) >= 2 and all(os.path.exists(p) for p in paths)  # SIGKILL left them behind ...
        removed = cleanup_stale_segments()  # ... which any node start (or this call) removes
        assert set(names) <= set(removed) and not any(os.path.exists(p) for p in paths)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("client_shm", [True, False])
def test_corruption_at_rest_is_caught_on_both_transports(client_shm: bool) -> None:
    with ShardNode() as node, ShardClient(timeout_s=5.0, shm=client_shm) as client:
        node.put("k", np.arange(5000, dtype=np.int32))
        node._corrupt_for_test("k", byte_index=4001)
        with pytest.raises(StoreError, match="checksum mismatch"):
            client.pull(node.address, [("k", 0, 5000)])
        (ok,) = client.pull(node.address, [("k", 0, 700)])  # ranges whose 1 KiB check blocks are clean are served
        np.testing.assert_array_equal(ok, np.arange(700))


@pytest.mark.parametrize("mode", ["shm", "shm_zero_copy", "tcp"])
def test_corrupt_segment_never_reaches_a_sub_range_consumer(mode: str) -> None:
    """Bit rot in a segment: every sub-range whose check blocks hold the bad byte is refused, however it
    is pulled (copied out of shm, viewed in place, merged zig-zag ranges, or sent over TCP)."""
    n = 40_000  # int32: 160,000 bytes, ~157 check blocks
    with ShardNode() as node, ShardClient(timeout_s=5.0, shm=mode != "tcp") as client:
        node.put("k", np.arange(n, dtype=np.int32))
        node.put("u8", np.arange(n, dtype=np.uint8))
        bad = 100_003  # byte 3 of element 25,000
        node._corrupt_for_test("k", byte_index=bad)
        node._corrupt_for_test("u8", byte_index=bad // 4)
        zc = mode == "shm_zero_copy"
        for pieces in ([("k", 25_000, 25_001)], [("k", 24_990, 25_010)], [("k", 24_800, 24_999)],  # same block
                       [("k", 0, 10), ("k", 24_000, 26_000)], [("u8", 25_000, 25_001)], [("u8", 1, n - 1)]):
            with pytest.raises(StoreError, match="checksum mismatch"):
                client.pull(node.address, pieces, zero_copy=zc, merge_runs=len(pieces) > 1)
        # the zig-zag CP ranges that avoid the bad block are served, and right
        first, second = client.pull(node.address, [("k", 0, 10_000), ("k", 30_000, n)], zero_copy=zc)
        np.testing.assert_array_equal(first, np.arange(10_000))
        np.testing.assert_array_equal(second, np.arange(30_000, n))
        (merged,) = client.pull(node.address, [("u8", 0, 5_000), ("u8", 35_000, n)], merge_runs=True)
        np.testing.assert_array_equal(merged, np.concatenate([np.arange(5_000), np.arange(35_000, n)]).astype(np.uint8))
        assert client.transport(node.address) == ("tcp" if mode == "tcp" else "shm")
        node.put("odd", np.arange(3001, dtype=np.uint8))  # its last check block ends in a partial word
        node._corrupt_for_test("odd", byte_index=3000)
        with pytest.raises(StoreError, match="checksum mismatch"):
            client.pull(node.address, [("odd", 2500, 3001)], zero_copy=zc)
        np.testing.assert_array_equal(client.pull(node.address, [("odd", 0, 1000)])[0], np.arange(1000).astype(np.uint8))


# --- bad input on the shared-memory path ----------------------------------------------------------------


def test_shm_offer_needs_authentication_first() -> None:
    with ShardNode(secret=b"s3cret", frame_timeout_s=5.0) as node:
        node.put("k", np.arange(10))
        for request in (wire.ShmOfferRequest(), wire.PullShmRequest([("k", 0, 10)])):
            sock = _raw(node.address)
            with sock:
                sock.sendall(wire.encode_frame(request))
                head, header = _read(sock)
                assert head.kind == wire.Kind.ERROR and header.code == ErrorCode.AUTH_FAILED  # type: ignore[attr-defined]
                sock.settimeout(5.0)
                assert sock.recv(1) == b""  # closed, and no segment or probe name was sent
        with ShardClient(secret=b"s3cret", timeout_s=5.0) as client:
            np.testing.assert_array_equal(client.pull(node.address, [("k", 2, 4)])[0], [2, 3])
            assert client.transport(node.address) == "shm"


@pytest.mark.parametrize(
    "pieces, code",
    [([("nope", 0, 1)], ErrorCode.UNKNOWN_KEY), ([("k", 0, 11)], ErrorCode.BAD_RANGE), ([("k", 5, 2)], ErrorCode.BAD_RANGE)],
)
def test_pull_shm_refusals_are_typed_and_the_connection_survives(pieces: list, code: ErrorCode) -> None:
    with ShardNode(frame_timeout_s=5.0) as node:
        node.put("k", np.arange(10, dtype=np.int16))
        sock = _raw(node.address)
        with sock:
            sock.sendall(wire.encode_frame(wire.ShmDone()))  # a stray SHM_DONE is harmless
            sock.sendall(wire.encode_frame(wire.PullShmRequest([("k", 0, 2), *pieces])))
            head, header = _read(sock)
            assert head.kind == wire.Kind.ERROR and header.code == code  # type: ignore[attr-defined]
            sock.sendall(b"".join([wire.PREFIX.pack(wire.MAGIC, 1, wire.Kind.PULL_SHM, 3, 0), b"\xc1\xc1\xc1"]))
            head, header = _read(sock)
            assert header.code == ErrorCode.MALFORMED  # type: ignore[attr-defined]
            sock.sendall(wire.encode_frame(wire.PullShmRequest([("k", 0, 10)])))
            head, reply = _read(sock)
            assert head.kind == wire.Kind.PULL_SHM_REPLY and reply.pieces[0].count == 10  # type: ignore[attr-defined]


def _lying_server(offer: wire.ShmOffer, reply: wire.PullShmReply) -> tuple[str, threading.Thread, socket.socket]:
    """Completes the handshake and the offer honestly, then answers a pull with `reply`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(wire.encode_frame(wire.Challenge(b"n" * wire.NONCE_BYTES, False)))
            _read(conn)
            conn.sendall(wire.encode_frame(offer))
            _read(conn)
            conn.sendall(wire.encode_frame(reply))
            conn.settimeout(5.0)
            try:
                conn.recv(1)
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread, listener


@pytest.mark.parametrize("case", ["path_escape", "probe_as_segment", "missing", "wrong_size", "offset_outside"])
def test_client_refuses_bogus_segment_locations(case: str) -> None:
    with ShardNode() as real:
        real.put("k", np.arange(100, dtype=np.int32))
        probe, seg = real.shm_segment_names()
        size = os.path.getsize(os.path.join(SHM_DIR, seg))
        pool = real._store.pool
        assert pool is not None
        offer = wire.ShmOffer(True, probe, pool.token)
        segments = {
            "path_escape": [wire.ShmSegment("../../etc/passwd", 1 << 20)],
            "probe_as_segment": [wire.ShmSegment(probe, 1 << 20)],
            "missing": [wire.ShmSegment(seg.rsplit("-", 1)[0] + "-99", size)],
            "wrong_size": [wire.ShmSegment(seg, size + 4096)],
            "offset_outside": [wire.ShmSegment(seg, size)],
        }[case]
        offset = size - 8 if case == "offset_outside" else 0
        reply = wire.PullShmReply(segments, [wire.ShmPiece("<i4", 100, -1, 0, offset)])
        address, thread, listener = _lying_server(offer, reply)
        with listener, ShardClient(timeout_s=5.0) as client:
            with pytest.raises((StoreError, PeerUnreachable)) as info:
                client.pull(address, [("k", 0, 100)])
        why = {"path_escape": "not one of ours", "probe_as_segment": "not one of ours", "missing": "cannot open",
               "wrong_size": "the peer said", "offset_outside": "is invalid"}[case]
        assert why in str(info.value) and not isinstance(info.value, RemoteError)
        thread.join(5.0)


# --- zero-copy reads ------------------------------------------------------------------------------------


def _await(condition: object, what: str) -> None:
    deadline = time.monotonic() + 5.0
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_zero_copy_views_keep_their_bytes_until_the_last_view_is_gone() -> None:
    with ShardNode() as node, ShardClient(timeout_s=5.0) as client:
        pool = node._store.pool
        assert pool is not None
        node.put_many({"a": np.arange(10_000, dtype=np.int64), "b": np.arange(100, dtype=np.float32)})
        assert pool.used_bytes == 80_000 + 448
        a, b = client.pull(node.address, [("a", 0, 10_000), ("b", 10, 20)], zero_copy=True)
        assert not a.flags.writeable and not a.flags.owndata
        np.testing.assert_array_equal(b, np.arange(10, 20, dtype=np.float32))
        tail = a[9_000:]  # a derived view keeps the reply's bytes alive as well
        node.drop(["a", "b"])
        node.put("c", np.full(10_000, -1, np.int64))  # cannot land on a's bytes while they are leased
        del a, b
        np.testing.assert_array_equal(tail, np.arange(9_000, 10_000))
        assert pool.used_bytes == 2 * 80_000 + 448
        del tail  # the last view: the lease ends (told to the node at once, the connection being idle)
        _await(lambda: pool.used_bytes == 80_000, "the lease to end")  # only "c" is left
        (c,) = client.pull(node.address, [("c", 0, 3)], zero_copy=True)
        np.testing.assert_array_equal(c, [-1, -1, -1])


def test_zero_copy_leases_end_with_the_connection_and_tcp_ignores_the_flag() -> None:
    with ShardNode() as node:
        pool = node._store.pool
        assert pool is not None
        node.put("a", np.arange(50_000, dtype=np.int32))
        client = ShardClient(timeout_s=5.0)
        (view,) = client.pull(node.address, [("a", 0, 50_000)], zero_copy=True)
        node.drop(["a"])
        assert pool.used_bytes >= 200_000  # leased
        client.close()  # the node ends every lease of a closed connection
        _await(lambda: pool.used_bytes == 0, "leases of a closed connection to end")
        del view
        node.put("b", np.arange(10, dtype=np.int32))
        with ShardClient(timeout_s=5.0, shm=False) as tcp:
            (got,) = tcp.pull(node.address, [("b", 0, 10)], zero_copy=True)
            assert got.flags.writeable and tcp.transport(node.address) == "tcp"


def test_pull_samples_zero_copy_matches_copies(client: ShardClient) -> None:
    with ShardNode() as node:
        records = _records("z", 8, seed=5)
        metas = ExperienceWriter(node, "p").put(records)
        for layout in (Layout(), Layout(dp_size=1, cp_size=2, cp_rank=1)):
            part = partition([m.total_tokens for m in metas], layout)
            ranges = part.ranges_by_position() if layout.cp_size > 1 else None
            mine = [metas[i] for i in part.rows]
            copied = pull_samples(client, mine, FIELDS, ranges)
            viewed = pull_samples(client, mine, FIELDS, ranges, zero_copy=True)
            for c, v in zip(copied, viewed):
                for name in FIELDS:
                    np.testing.assert_array_equal(c[name], v[name])


@pytest.mark.parametrize("client_shm, zero_copy", [(True, False), (True, True), (False, False)])
def test_merge_runs_gives_one_array_per_run_of_a_key(client_shm: bool, zero_copy: bool) -> None:
    with ShardNode(shm_segment_bytes=2 << 20) as node, ShardClient(timeout_s=5.0, shm=client_shm) as client:
        big = np.arange(600_000, dtype=np.int32)  # 2.4 MiB: private memory, inline in the reply
        small = np.arange(1000, dtype=np.float32)  # in shared memory
        node.put_many({"big": big, "small": small})
        pieces = [("small", 0, 10), ("small", 900, 1000), ("big", 5, 7), ("big", 0, 0), ("big", 599_990, 600_000), ("small", 3, 4)]
        got = client.pull(node.address, pieces, zero_copy=zero_copy, merge_runs=True)
        assert [g.dtype for g in got] == [np.float32, np.int32, np.float32]
        np.testing.assert_array_equal(got[0], np.concatenate([small[:10], small[900:]]))
        np.testing.assert_array_equal(got[1], np.concatenate([big[5:7], big[599_990:]]))
        np.testing.assert_array_equal(got[2], small[3:4])
        assert got[2].flags.writeable != (zero_copy and client_shm)  # a single shm piece is a view only with zero_copy
        assert got[0].flags.writeable  # a run of several ranges is always one copy
