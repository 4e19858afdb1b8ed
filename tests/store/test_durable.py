"""Durable experience on disk (store/durable.py): generations written atomically, read back exactly,
and refused (logged, never raised) when truncated, corrupt, or from another run or model."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from earl_stream.records import TOKEN_FIELDS
from earl_stream.store.durable import Identity, PersistRefused, Slot, decode, encode
from earl_stream.store.experience import ExperienceWriter, record_checksum
from earl_stream.store.node import ShardNode
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta

ME = Identity(run="run-a", model="/m#1")


def _samples(n: int) -> list[tuple[SampleMeta, dict[str, np.ndarray]]]:
    out = []
    for i in range(n):
        t = 5 + i
        fields = {name: (np.arange(t) * (i + 1)).astype(dtype) for name, dtype in TOKEN_FIELDS.items()}
        meta = SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"g{i}.0-e{i}", prompt_ordinal=i, episode_id=f"e{i}",
                          group_id=f"g{i}.0", env="e", turns=1, prompt_tokens=2, response_tokens=t - 2, total_tokens=t,
                          reward=0.5, advantage=None, policy_version_min=0, policy_version_max=1, producer_id="w",
                          producer_address="127.0.0.1:1", checksum=record_checksum(fields), created_at=time.time(),
                          info_json="{}")
        out.append((meta, fields))
    return out


def test_a_generation_reads_back_exactly(tmp_path: Path) -> None:
    slot = Slot(tmp_path, host="h")
    samples = _samples(3)
    slot.write(ME, 4, samples[:1])
    path = slot.write(ME, 6, samples)
    assert [p.name for p in slot.dir.glob("gen-*")] == [path.name]  # the older generation is gone
    assert not list(slot.dir.glob("*.tmp"))
    slot.close()
    again = Slot(tmp_path, host="h")  # the next worker on this host takes the same slot
    assert again.dir == slot.dir
    got_path, got = again.load(ME)
    assert got_path == path and [m for m, _ in got] == [m for m, _ in samples]
    for (_, a), (_, b) in zip(got, samples):
        assert all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in TOKEN_FIELDS)


def test_a_live_slot_is_not_shared(tmp_path: Path) -> None:
    first = Slot(tmp_path, host="h")
    second = Slot(tmp_path, host="h")
    assert first.dir != second.dir
    first.close()
    second.close()


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[: len(b) - 7], "truncated"),
    (lambda b: b[:-20] + bytes([b[-20] ^ 1]) + b[-19:], "corrupt"),
    (lambda b: b"X" + b[1:], "bad magic"),
    (lambda b: b[:10], "truncated header"),
])
def test_damaged_files_are_refused(damage, reason: str) -> None:
    data = encode(ME, 2, _samples(2))
    with pytest.raises(PersistRefused, match=reason):
        decode(damage(data), ME)


def test_another_run_or_model_is_refused_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = encode(ME, 2, _samples(2))
    with pytest.raises(PersistRefused, match="another run"):
        decode(data, Identity(run="run-b", model=ME.model))
    with pytest.raises(PersistRefused, match="another model"):
        decode(data, Identity(run=ME.run, model="/other#2"))
    slot = Slot(tmp_path, host="h")
    (slot.dir / "gen-00000009.exp").write_bytes(data[:-3])
    (slot.dir / "gen-00000010.tmp").write_bytes(data)  # a write cut short before its rename
    with caplog.at_level(logging.WARNING, logger="earl_stream.store.durable"):
        path, samples = slot.load(ME)
    assert samples == [] and path is not None and path.name == "gen-00000009.exp"
    assert str(path) in caplog.text and "re-played" in caplog.text
    assert not list(slot.dir.glob("*.tmp"))


def test_a_row_that_does_not_match_its_checksum_is_refused() -> None:
    samples = _samples(2)
    samples[1][1]["input_ids"][0] += 1  # bytes changed before writing: the header crc is right, the row is not
    with pytest.raises(PersistRefused, match="checksum"):
        decode(encode(ME, 2, samples), ME)


def test_a_writer_persists_what_it_holds_and_serves_it_again(tmp_path: Path) -> None:
    samples = _samples(3)
    with ShardNode(shm=False) as old, ShardNode(shm=False) as new:
        writer = ExperienceWriter(old, "w1")
        for meta, fields in samples:
            writer.restore(meta, fields)
        writer.free([samples[0][0].sample_id])
        held = writer.held_samples()
        assert sorted(m.sample_id for m, _ in held) == sorted(m.sample_id for m, _ in samples[1:])
        slot = Slot(tmp_path, host="h")
        slot.write(ME, 1, held)
        _, loaded = slot.load(ME)
        again = ExperienceWriter(new, "w2")
        rows = [again.restore(m, f) for m, f in loaded]
        assert {r.producer_address for r in rows} == {new.address} and {r.producer_id for r in rows} == {"w2"}
        assert again.samples_held == 2


def test_a_worker_without_a_writable_run_dir_runs_without_durable_experience(tmp_path: Path) -> None:
    from earl_stream.config import RunConfig, replace
    from earl_stream.workers.durable import DurableSamples

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    cfg = replace(RunConfig(), f"run_dir={blocked / 'run'}", f"model.path={tmp_path}")
    with ShardNode(shm=False) as node:
        writer = ExperienceWriter(node, "w")
        assert DurableSamples.open(cfg, "run-a", writer) is None
        assert DurableSamples.open(replace(cfg, "store.durable_experience=false"), "run-a", writer) is None
        ok = DurableSamples.open(replace(cfg, f"run_dir={tmp_path / 'run'}"), "run-a", writer)
        assert ok is not None and ok.slot.dir.parent == tmp_path / "run" / "experience"
        ok.close()


def test_a_well_formed_file_with_a_bad_payload_is_refused() -> None:
    """A body whose crc matches but whose payload column is not whole elements (a crafted file)."""
    import json
    import struct
    import zlib

    import pyarrow as pa

    from earl_stream.store.durable import MAGIC
    from earl_stream.store.schema import metas_to_table

    meta, _ = _samples(1)[0]
    table = metas_to_table([meta])
    for name in TOKEN_FIELDS:
        table = table.append_column("payload." + name, pa.array([b"\x01\x02\x03"], type=pa.large_binary()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    body = sink.getvalue().to_pybytes()
    header = json.dumps({"format": 1, "run": ME.run, "model": ME.model, "checkpoint_version": 0, "samples": 1,
                         "body_bytes": len(body), "body_crc32": zlib.crc32(body)}).encode()
    with pytest.raises(PersistRefused, match="unreadable payload|checksum"):
        decode(MAGIC + struct.pack("!I", len(header)) + header + body, ME)


def _routed_records(n: int) -> list:
    """n records, the odd ones with routed_experts of a 2-layer top-2 MoE (uint8) and one int16 (>= 255 experts)."""
    from earl_stream.records import SampleRecord

    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        t = 6 + i
        routed = None
        if i % 2:
            dtype = np.int16 if i == 3 else np.uint8
            routed = rng.integers(0, 250, (t, 2, 2)).astype(dtype)
            routed[-1] = -1 if dtype == np.int16 else 255  # the last token is never fed
        out.append(SampleRecord(
            sample_id=f"r{i}", prompt_ordinal=i, episode_id=f"e{i}", group_id=f"g{i}", env="t", turns=1, prompt_tokens=2,
            input_ids=np.arange(t, dtype=np.int32), loss_mask=(np.arange(t) >= 2).astype(np.uint8),
            behaviour_logprobs=np.zeros(t, np.float32), policy_version=np.zeros(t, np.int32), reward=1.0,
            routed_experts=routed))
    return out


def test_routed_experts_persist_and_are_served_again_exactly(tmp_path: Path) -> None:
    """A resumed worker serves each sample's routed_experts byte for byte (its info's crc checks them); samples
    without routing (dense) stay without."""
    from earl_stream.records import ROUTED_EXPERTS
    from earl_stream.store import ShardClient, pull_samples

    records = _routed_records(4)
    with ShardNode(shm=False) as old, ShardNode(shm=False) as new:
        writer = ExperienceWriter(old, "w1")
        writer.put(records)
        slot = Slot(tmp_path, host="h")
        slot.write(ME, 3, writer.held_samples())
        slot.close()
        _, loaded = Slot(tmp_path, host="h").load(ME)  # the restarted worker's slot
        by_id = {m.sample_id: f for m, f in loaded}
        for rec in records:
            if rec.routed_experts is None:
                assert ROUTED_EXPERTS not in by_id[rec.sample_id]
            else:
                got = by_id[rec.sample_id][ROUTED_EXPERTS]
                assert got.dtype == rec.routed_experts.dtype
                np.testing.assert_array_equal(got.reshape(rec.routed_experts.shape), rec.routed_experts)
        again = ExperienceWriter(new, "w2")
        rows = [again.restore(m, f) for m, f in loaded]
        routed_rows = [r for r in rows if r.sample_id in {"r1", "r3"}]
        with ShardClient(timeout_s=10.0) as client:
            for meta in routed_rows:  # one dtype per pull (uint8 and int16 here)
                (row,) = pull_samples(client, [meta], [*TOKEN_FIELDS, ROUTED_EXPERTS])  # crc-checked on arrival
                want = records[int(meta.sample_id[1:])].routed_experts
                assert want is not None
                np.testing.assert_array_equal(row[ROUTED_EXPERTS].reshape(want.shape), want)


def test_routed_experts_that_do_not_match_are_refused(tmp_path: Path) -> None:
    """Routing bytes changed on disk (the body crc recomputed, as a crafted file would) or dropped from a
    row whose info describes them: the generation is refused, never served with wrong routing."""
    from earl_stream.records import ROUTED_EXPERTS

    with ShardNode(shm=False) as node:
        writer = ExperienceWriter(node, "w1")
        writer.put(_routed_records(2))
        held = writer.held_samples()
    routed = next(f for _, f in held if ROUTED_EXPERTS in f)
    routed[ROUTED_EXPERTS][4] ^= 1
    with pytest.raises(PersistRefused, match="routed_experts do not match"):
        decode(encode(ME, 1, held), ME)
    routed[ROUTED_EXPERTS] = routed[ROUTED_EXPERTS][:-2]
    with pytest.raises(PersistRefused, match="routed_experts do not match"):
        decode(encode(ME, 1, held), ME)
    del routed[ROUTED_EXPERTS]
    with pytest.raises(PersistRefused, match="does not hold"):
        decode(encode(ME, 1, held), ME)
