"""Producer and consumer sides of sample records in the experience store.

Owns `ExperienceWriter` (a rollout worker stores each record's token fields in its own shard node and
gets back the `SampleMeta` rows it sends to the supervisor) and `pull_samples` (a consumer fetches the
fields and token ranges it needs straight from the producers). Deciding which rows and ranges a rank
needs is `layout.py`'s; keeping the index of rows is the supervisor's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from earl_stream.errors import StoreError
from earl_stream.records import TOKEN_FIELDS, SampleRecord
from earl_stream.store.client import PeerUnreachable, RemoteError, ShardClient
from earl_stream.store.node import ShardNode
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, sample_key, sample_prefix
from earl_stream.store.wire import ErrorCode

log = logging.getLogger(__name__)
_INFO_WARN_BYTES = 64 << 10


class SamplesUnavailable(StoreError):
    """Some samples could not be pulled (producer gone, or it no longer holds them).

    `sample_ids`: the ones lost (the caller reports them so their prompts are re-issued); `partial`:
    per requested meta, its fields if they were pulled, else None; `causes`: address -> reason.
    """

    def __init__(self, sample_ids: list[str], partial: list[dict[str, np.ndarray] | None], causes: dict[str, str]) -> None:
        shown = ", ".join(sample_ids[:5]) + (" ..." if len(sample_ids) > 5 else "")
        super().__init__(f"{len(sample_ids)} sample(s) unavailable ({shown}): " + "; ".join(causes.values()))
        self.sample_ids = sample_ids
        self.partial = partial
        self.causes = causes


def record_checksum(fields: Mapping[str, np.ndarray]) -> int:
    """crc32 of the token fields' bytes concatenated in TOKEN_FIELDS order."""
    crc = 0
    for name in TOKEN_FIELDS:
        crc = zlib.crc32(np.ascontiguousarray(fields[name]).view(np.uint8), crc)
    return crc


class ExperienceWriter:
    """Stores finished episodes in this process's shard node; thread-safe."""

    def __init__(self, node: ShardNode, producer_id: str) -> None:
        self._node = node
        self._producer_id = producer_id
        self._held: set[str] = set()
        self._lock = threading.Lock()

    def put(self, records: Sequence[SampleRecord]) -> list[SampleMeta]:
        """Store every record's token fields under `sample_key`; one meta per record, in order.

        Each record becomes visible atomically. If one fails (e.g. back-pressure timeout), the records
        of this call already stored are dropped again and the StoreError propagates.
        """
        metas: list[SampleMeta] = []
        try:
            for record in records:
                metas.append(self._put_one(record))
        except BaseException:
            self.free([m.sample_id for m in metas])
            raise
        return metas

    def _put_one(self, record: SampleRecord) -> SampleMeta:
        fields = {name: np.ascontiguousarray(arr) for name, arr in record.token_fields().items()}
        try:
            info_json = json.dumps(record.info, separators=(",", ":"), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise StoreError(f"sample {record.sample_id}: info is not JSON-serialisable: {exc}") from exc
        if len(info_json) > _INFO_WARN_BYTES:
            log.warning("sample %s: info is %d bytes of JSON; keep metadata small", record.sample_id, len(info_json))
        versions = fields["policy_version"]
        model_versions = versions[versions >= 0]
        meta = SampleMeta(
            schema_version=SCHEMA_VERSION,
            sample_id=record.sample_id,
            prompt_ordinal=int(record.prompt_ordinal),
            episode_id=record.episode_id,
            group_id=record.group_id,
            env=record.env,
            turns=int(record.turns),
            prompt_tokens=int(record.prompt_tokens),
            response_tokens=record.response_tokens,
            total_tokens=record.num_tokens,
            reward=float(record.reward),
            advantage=None,
            policy_version_min=int(model_versions.min()) if model_versions.size else -1,
            policy_version_max=int(model_versions.max()) if model_versions.size else -1,
            producer_id=self._producer_id,
            producer_address=self._node.address,
            checksum=record_checksum(fields),
            created_at=time.time(),
            info_json=info_json,
        )
        self._node.put_many({sample_key(record.sample_id, name): arr for name, arr in fields.items()})
        with self._lock:
            self._held.add(record.sample_id)
        return meta

    def free(self, sample_ids: Iterable[str]) -> int:
        """Drop the shards of these samples (unknown ids are ignored); returns bytes freed."""
        freed = 0
        for sid in sample_ids:
            freed += self._node.drop_prefix(sample_prefix(sid))
            with self._lock:
                self._held.discard(sid)
        return freed

    def held_sample_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._held)


def pull_samples(
    client: ShardClient,
    metas: Sequence[SampleMeta],
    fields: Sequence[str],
    token_ranges: Mapping[int, list[tuple[int, int]]] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Fetch `fields` of every meta straight from its producer; one dict field -> 1-D array per meta.

    `token_ranges` maps a position in `metas` to the [start, end) ranges needed (concatenated in the
    result); None pulls whole rows ([total_tokens] each) and then checks each row against
    `meta.checksum` when all TOKEN_FIELDS were pulled. Raises `SamplesUnavailable` naming the samples
    whose producer is unreachable or no longer holds them.
    """
    unknown = [f for f in fields if f not in TOKEN_FIELDS]
    if unknown or not fields:
        raise StoreError(f"fields {list(fields)} must be a non-empty subset of {list(TOKEN_FIELDS)}")
    by_address: dict[str, list[tuple[str, int, int]]] = {}
    slots: list[list[tuple[str, str, int]]] = []  # per meta: (field, address, index into address pieces)
    for pos, meta in enumerate(metas):
        ranges = _ranges_for(pos, meta, token_ranges)
        pieces = by_address.setdefault(meta.producer_address, [])
        meta_slots = []
        for name in fields:
            key = sample_key(meta.sample_id, name)
            for start, end in ranges:
                meta_slots.append((name, meta.producer_address, len(pieces)))
                pieces.append((key, start, end))
        slots.append(meta_slots)
    results = client.pull_many(by_address, return_exceptions=True)
    causes = {}
    for address, res in results.items():
        if isinstance(res, (PeerUnreachable, RemoteError)) and _means_lost(res):
            causes[address] = str(res)
        elif isinstance(res, BaseException):
            raise res
    out: list[dict[str, np.ndarray] | None] = []
    for meta, meta_slots in zip(metas, slots):
        if meta.producer_address in causes:
            out.append(None)
            continue
        parts: dict[str, list[np.ndarray]] = {name: [] for name in fields}
        for name, address, index in meta_slots:
            parts[name].append(results[address][index])
        row = {name: p[0] if len(p) == 1 else np.concatenate(p) for name, p in parts.items()}
        if token_ranges is None:
            _verify_row(meta, row)
        out.append(row)
    if causes:
        lost = [m.sample_id for m, r in zip(metas, out) if r is None]
        raise SamplesUnavailable(lost, out, causes)
    return out  # type: ignore[return-value]  # no None left when nothing was lost


def _ranges_for(pos: int, meta: SampleMeta, token_ranges: Mapping[int, list[tuple[int, int]]] | None) -> list[tuple[int, int]]:
    if token_ranges is None:
        return [(0, meta.total_tokens)]
    if pos not in token_ranges:
        raise StoreError(f"token_ranges has no entry for position {pos} (sample {meta.sample_id})")
    ranges = [(int(s), int(e)) for s, e in token_ranges[pos]]
    for s, e in ranges:
        if not 0 <= s <= e <= meta.total_tokens:
            raise StoreError(f"range [{s}, {e}) outside sample {meta.sample_id} of {meta.total_tokens} tokens")
    return ranges


def _means_lost(exc: StoreError) -> bool:
    # A restarted producer at the same address no longer knows the key: the sample is just as lost.
    return isinstance(exc, PeerUnreachable) or (isinstance(exc, RemoteError) and exc.code == ErrorCode.UNKNOWN_KEY)


def _verify_row(meta: SampleMeta, row: Mapping[str, np.ndarray]) -> None:
    for name, arr in row.items():
        if arr.shape != (meta.total_tokens,) or arr.dtype != TOKEN_FIELDS[name]:
            raise StoreError(
                f"sample {meta.sample_id}: {name} arrived as {arr.dtype}{list(arr.shape)}, "
                f"expected {TOKEN_FIELDS[name]}[{meta.total_tokens}]"
            )
    if set(row) == set(TOKEN_FIELDS) and record_checksum(row) != meta.checksum:
        raise StoreError(
            f"sample {meta.sample_id} from {meta.producer_address}: checksum of the pulled row does not match its "
            "metadata; the producer's copy is corrupt: report the sample lost"
        )
