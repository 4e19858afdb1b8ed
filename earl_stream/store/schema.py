"""Sample metadata: the row type and Arrow schema of the layout index.

Owns `SampleMeta` (one immutable row per finished episode), its Arrow schema `METADATA_SCHEMA`, the
conversions between the two, the Arrow IPC encoding that claims carry over the control plane, and the
key under which a sample's token shards live in its producer's shard node (`sample_key`).
It does not own the index itself (the supervisor keeps the rows) nor the shard bytes (`node.py`).
Parquet export is plain `pyarrow.parquet.write_table(metas_to_table(metas), path)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pyarrow as pa

from earl_stream.errors import ProtocolError, StoreError

SCHEMA_VERSION = 1
_VERSION_META_KEY = b"earl_stream.sample_meta.schema_version"


class SampleMeta(msgspec.Struct, frozen=True):
    """Metadata of one sample; its token shards ([total_tokens] each) stay in the producer's node.

    `checksum` is the crc32 of the token fields' bytes concatenated in `TOKEN_FIELDS` order;
    `producer_address` is the "host:port" of the producer's `ShardNode`; `info_json` is small JSON.
    """

    schema_version: int
    sample_id: str
    prompt_ordinal: int
    episode_id: str
    group_id: str
    env: str
    turns: int
    prompt_tokens: int
    response_tokens: int
    total_tokens: int
    reward: float
    advantage: float | None
    policy_version_min: int
    policy_version_max: int
    producer_id: str
    producer_address: str
    checksum: int
    created_at: float
    info_json: str
    # an episode kept as several samples (`rollout.non_append=split`): this row is segment `segment` of
    # `segments`; they share episode_id, group and reward (see `episode_key`)
    segment: int = 0
    segments: int = 1


METADATA_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("schema_version", pa.int32(), nullable=False),
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("prompt_ordinal", pa.int64(), nullable=False),
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("env", pa.string(), nullable=False),
        pa.field("turns", pa.int32(), nullable=False),
        pa.field("prompt_tokens", pa.int64(), nullable=False),
        pa.field("response_tokens", pa.int64(), nullable=False),
        pa.field("total_tokens", pa.int64(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("advantage", pa.float64(), nullable=True),
        pa.field("policy_version_min", pa.int64(), nullable=False),
        pa.field("policy_version_max", pa.int64(), nullable=False),
        pa.field("producer_id", pa.string(), nullable=False),
        pa.field("producer_address", pa.string(), nullable=False),
        pa.field("checksum", pa.uint32(), nullable=False),
        pa.field("created_at", pa.float64(), nullable=False),
        pa.field("info_json", pa.string(), nullable=False),
        pa.field("segment", pa.int32(), nullable=False),
        pa.field("segments", pa.int32(), nullable=False),
    ],
    metadata={_VERSION_META_KEY: str(SCHEMA_VERSION).encode()},
)

assert tuple(METADATA_SCHEMA.names) == SampleMeta.__struct_fields__, "schema and struct drifted apart"
# columns added after SCHEMA_VERSION 1 was first written: a table without them (an older durable file) reads
# as one sample per episode
_DEFAULTED = {"segment": 0, "segments": 1}


def episode_key(meta: SampleMeta) -> str:
    """The episode a row belongs to, for the advantage (one reward per episode): its own sample id when the
    episode is one sample, else its group and episode id, shared by all its segments."""
    return meta.sample_id if meta.segments <= 1 else f"{meta.group_id}:{meta.episode_id}"


def sample_key(sample_id: str, field: str) -> str:
    """Key of one token field of one sample in its producer's shard node: `s/{sample_id}/{field}`."""
    if not sample_id or "/" in sample_id:
        raise StoreError(f"sample_id {sample_id!r} must be non-empty and contain no '/' (it is part of a shard key)")
    return f"s/{sample_id}/{field}"


def sample_prefix(sample_id: str) -> str:
    """Key prefix of every shard of one sample (for `ShardNode.drop_prefix`)."""
    return sample_key(sample_id, "")


def metas_to_table(metas: Sequence[SampleMeta]) -> pa.Table:
    """One Arrow row per meta, in order, with `METADATA_SCHEMA`."""
    columns = {name: [getattr(m, name) for m in metas] for name in METADATA_SCHEMA.names}
    return pa.Table.from_pydict(columns, schema=METADATA_SCHEMA)


def table_to_metas(table: pa.Table) -> list[SampleMeta]:
    """Rows of a metadata table back to `SampleMeta`s; refuses another schema version or missing columns."""
    version = (table.schema.metadata or {}).get(_VERSION_META_KEY)
    if version is not None and version != str(SCHEMA_VERSION).encode():
        raise StoreError(
            f"metadata table has schema version {version.decode(errors='replace')}, this build reads "
            f"{SCHEMA_VERSION}; upgrade the older process"
        )
    missing = [n for n in METADATA_SCHEMA.names if n not in table.column_names and n not in _DEFAULTED]
    if missing:
        raise StoreError(f"metadata table lacks columns {missing}; it was not built by metas_to_table")
    rows = table.select([n for n in METADATA_SCHEMA.names if n in table.column_names]).to_pylist()
    try:
        metas = msgspec.convert(rows, list[SampleMeta])
    except msgspec.ValidationError as exc:
        raise StoreError(f"metadata table has an invalid row: {exc}") from exc
    stale = {m.schema_version for m in metas} - {SCHEMA_VERSION}
    if stale:
        raise StoreError(f"metadata rows carry schema versions {sorted(stale)}, this build reads {SCHEMA_VERSION}")
    return metas


def table_to_ipc(table: pa.Table) -> bytes:
    """Encode a table as an Arrow IPC stream (what a claim carries over the control plane)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def table_from_ipc(data: bytes) -> pa.Table:
    """Decode an Arrow IPC stream; garbage raises `ProtocolError`."""
    try:
        with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
            return reader.read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError) as exc:
        raise ProtocolError(f"not an Arrow IPC stream of metadata rows: {exc}") from exc
