"""SampleMeta <-> Arrow table <-> IPC bytes / Parquet, and the schema's guards."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from earl_stream.errors import ProtocolError, StoreError
from earl_stream.store.schema import (
    METADATA_SCHEMA,
    SCHEMA_VERSION,
    SampleMeta,
    metas_to_table,
    sample_key,
    table_from_ipc,
    table_to_ipc,
    table_to_metas,
)


def _meta(i: int, advantage: float | None = None) -> SampleMeta:
    return SampleMeta(
        schema_version=SCHEMA_VERSION,
        sample_id=f"w0-{i}",
        prompt_ordinal=i,
        episode_id=f"e{i}",
        group_id=f"g{i // 4}",
        env="tictactoe",
        turns=3,
        prompt_tokens=10,
        response_tokens=5 + i,
        total_tokens=40 + i,
        reward=0.5 * i,
        advantage=advantage,
        policy_version_min=2,
        policy_version_max=3,
        producer_id="rollout-0",
        producer_address="127.0.0.1:5555",
        checksum=0xFFFFFFFF - i,
        created_at=1.7e9 + i,
        info_json='{"winner":"x"}',
    )


METAS = [_meta(i, advantage=None if i % 2 else -0.25 * i) for i in range(7)]


def test_table_round_trip_keeps_every_field() -> None:
    table = metas_to_table(METAS)
    assert table.schema.equals(METADATA_SCHEMA, check_metadata=True)
    assert table.num_rows == 7 and table.column("advantage").null_count == 3
    assert table_to_metas(table) == METAS


def test_ipc_round_trip_and_garbage() -> None:
    data = table_to_ipc(metas_to_table(METAS))
    assert isinstance(data, bytes)
    table = table_from_ipc(data)
    assert table_to_metas(table) == METAS
    with pytest.raises(ProtocolError):
        table_from_ipc(b"definitely not arrow")


def test_parquet_export(tmp_path: Path) -> None:
    path = tmp_path / "episodes.parquet"
    pq.write_table(metas_to_table(METAS), path)
    assert table_to_metas(pq.read_table(path)) == METAS


def test_empty_and_concatenated_tables() -> None:
    assert table_to_metas(metas_to_table([])) == []
    both = pa.concat_tables([metas_to_table(METAS[:3]), metas_to_table(METAS[3:])])
    assert table_to_metas(both) == METAS


def test_other_schema_versions_are_refused() -> None:
    table = metas_to_table(METAS)
    newer = table.replace_schema_metadata({b"earl_stream.sample_meta.schema_version": b"2"})
    with pytest.raises(StoreError, match="schema version 2"):
        table_to_metas(newer)
    old_rows = [msgspec.structs.replace(m, schema_version=0) for m in METAS[:1]]
    with pytest.raises(StoreError, match="schema versions"):
        table_to_metas(metas_to_table(old_rows))
    with pytest.raises(StoreError, match="lacks columns"):
        table_to_metas(table.drop_columns(["checksum"]))


def test_sample_key() -> None:
    assert sample_key("w0-1", "input_ids") == "s/w0-1/input_ids"
    with pytest.raises(StoreError):
        sample_key("a/b", "input_ids")
    with pytest.raises(StoreError):
        sample_key("", "input_ids")


def test_metas_are_frozen_and_msgspec_encodable() -> None:
    with pytest.raises(AttributeError):
        METAS[0].reward = 1.0  # type: ignore[misc]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(METAS), type=list[SampleMeta]) == METAS
