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
from typing import Any, Protocol

import msgspec
import numpy as np

from earl_stream.env.images import Image, received_images
from earl_stream.errors import StoreError
from earl_stream.records import (
    IMAGES,
    ROUTED_EXPERTS,
    TOKEN_FIELDS,
    SampleImage,
    SampleRecord,
    image_byte_ranges,
    images_info,
    routing_info,
)
from earl_stream.store.client import PeerUnreachable, RemoteError
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
        self._held: dict[str, SampleMeta] = {}  # sample id -> its metadata row, while stored
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
        info = record.info
        if record.routed_experts is not None:  # stored flat, described (and checked) by the metadata
            flat = fields[ROUTED_EXPERTS] = np.ascontiguousarray(record.routed_experts).reshape(-1)
            _, layers, top_k = record.routed_experts.shape
            info = {**info, ROUTED_EXPERTS: {"layers": layers, "top_k": top_k, "dtype": flat.dtype.str,
                                             "crc32": zlib.crc32(flat.view(np.uint8))}}
        if record.images:  # the PNGs back to back, described (and checked) by the metadata
            pngs = [img.image.png for img in record.images]
            flat = fields[IMAGES] = np.frombuffer(b"".join(pngs), dtype=np.uint8)
            info = {**info, IMAGES: {"spans": [[i.start, i.tokens, i.image.width, i.image.height, len(i.image.png)]
                                               for i in record.images], "crc32": zlib.crc32(flat)}}
        try:
            info_json = json.dumps(info, separators=(",", ":"), sort_keys=True)
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
            checksum=record_checksum(fields),  # TOKEN_FIELDS only: routed_experts has its own in info
            created_at=time.time(),
            info_json=info_json,
            segment=int(record.segment),
            segments=int(record.segments),
        )
        self._node.put_many({sample_key(record.sample_id, name): arr for name, arr in fields.items()})
        with self._lock:
            self._held[record.sample_id] = meta
        return meta

    def restore(self, meta: SampleMeta, fields: Mapping[str, np.ndarray]) -> SampleMeta:
        """Serve a sample persisted by an earlier producer (store/durable.py): stored here, its row now
        names this producer and node."""
        meta = msgspec.structs.replace(meta, producer_id=self._producer_id, producer_address=self._node.address)
        self._node.put_many({sample_key(meta.sample_id, name): np.ascontiguousarray(fields[name])
                             for name in (*TOKEN_FIELDS, ROUTED_EXPERTS, IMAGES) if name in fields})
        with self._lock:
            self._held[meta.sample_id] = meta
        return meta

    def held_samples(self) -> list[tuple[SampleMeta, dict[str, np.ndarray]]]:
        """Copies of every sample held (metadata row, token fields), e.g. to persist them."""
        with self._lock:
            metas = list(self._held.values())
        out = []
        for meta in metas:
            info = json.loads(meta.info_json)
            names = [*TOKEN_FIELDS, *([ROUTED_EXPERTS] if routing_info(info) is not None else []),
                     *([IMAGES] if images_info(info) is not None else [])]
            keys = {sample_key(meta.sample_id, name): name for name in names}
            arrays = self._node.copy(keys)
            if len(arrays) == len(keys):  # else freed meanwhile
                out.append((meta, {keys[k]: a for k, a in arrays.items()}))
        return out

    @property
    def samples_held(self) -> int:
        """Samples whose shards this writer still holds (stored and not yet freed)."""
        with self._lock:
            return len(self._held)

    def free(self, sample_ids: Iterable[str]) -> int:
        """Drop the shards of these samples (unknown ids are ignored); returns bytes freed."""
        freed = 0
        for sid in sample_ids:
            freed += self._node.drop_prefix(sample_prefix(sid))
            with self._lock:
                self._held.pop(sid, None)
        return freed

    def held_sample_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._held)


class Puller(Protocol):
    """What `pull_samples` needs from a client: `ShardClient`, or `CentralClient` in central mode."""

    def pull(
        self,
        address: str,
        pieces: Sequence[tuple[str, int, int]],
        *,
        timeout_s: float | None = None,
        zero_copy: bool = False,
        merge_runs: bool = False,
    ) -> list[np.ndarray]: ...

    def pull_many(
        self,
        requests: Mapping[str, Sequence[tuple[str, int, int]]],
        *,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
        zero_copy: bool = False,
        merge_runs: bool = False,
    ) -> dict[str, Any]: ...


class InProcessPuller:
    """The `Puller` interface over rows held in this process (store key -> 1-D array), for a trainer fed
    from memory rather than from producers (benchmarks that measure the trainer alone, tests); counts the
    bytes it hands out in `bytes`. Ranges of one key asked back to back come back as one array, as
    `merge_runs` does."""

    def __init__(self, rows: Mapping[str, np.ndarray]) -> None:
        self.rows, self.bytes = rows, 0

    def pull(self, address: str, pieces: Sequence[tuple[str, int, int]], **_: Any) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        last = None
        for key, start, end in pieces:
            part = self.rows[key][start:end]
            self.bytes += part.nbytes
            if key == last:
                out[-1] = np.concatenate([out[-1], part])
            else:
                out.append(part.copy())
            last = key
        return out

    def pull_many(self, requests: Mapping[str, Sequence[tuple[str, int, int]]], **_: Any) -> dict[str, Any]:
        return {addr: self.pull(addr, pieces) for addr, pieces in requests.items()}


def pull_samples(
    client: Puller,
    metas: Sequence[SampleMeta],
    fields: Sequence[str],
    token_ranges: Mapping[int, list[tuple[int, int]]] | None = None,
    *,
    dtypes: Mapping[str, np.dtype] | None = None,
    zero_copy: bool = False,
) -> list[dict[str, np.ndarray]]:
    """Fetch `fields` of every meta straight from its producer; one dict field -> 1-D array per meta.

    `token_ranges` maps a position in `metas` to the [start, end) ranges needed (concatenated in the
    result); None pulls whole rows ([total_tokens] each) and then checks each row against
    `meta.checksum` when all TOKEN_FIELDS were pulled. One request per producer, producers in
    parallel. `dtypes` declares per-token fields a producer stored beyond TOKEN_FIELDS (e.g.
    {"advantages": float32}, put under `sample_key(sample_id, "advantages")`). `zero_copy`: rows
    from same-host producers are read-only views into their shared memory, which the producer keeps
    while any of them is alive (see `ShardClient.pull`); a row of several ranges is one copy. Raises
    `SamplesUnavailable` naming the samples whose producer is unreachable or no longer holds them
    (the others are in its `partial`).
    """
    known = {**TOKEN_FIELDS, **{k: np.dtype(v) for k, v in (dtypes or {}).items()}}
    if ROUTED_EXPERTS in fields:  # its dtype and width per token come with each sample's metadata
        known[ROUTED_EXPERTS] = _routing_of(metas)[0]
    unknown = [f for f in fields if f not in known]
    if unknown or not fields:
        raise StoreError(f"fields {list(fields)} must be a non-empty subset of {list(known)}")
    wanted = [_pieces_for(pos, meta, fields, token_ranges) for pos, meta in enumerate(metas)]
    positions: dict[str, list[int]] = {}
    for pos, meta in enumerate(metas):
        positions.setdefault(meta.producer_address, []).append(pos)
    requests = {addr: [p for pos in poss for p in wanted[pos]] for addr, poss in positions.items()}
    # One array per row and field: the client lays a row's ranges back to back (`merge_runs`).
    results = client.pull_many(requests, return_exceptions=True, zero_copy=zero_copy, merge_runs=True)
    out: list[dict[str, np.ndarray] | None] = [None] * len(metas)
    causes: dict[str, str] = {}
    for address, res in results.items():
        if isinstance(res, RemoteError) and res.code == ErrorCode.UNKNOWN_KEY:
            # The producer freed (or, restarted, forgot) some of them: find out which, one by one.
            res = _pull_one_by_one(client, address, [wanted[pos] for pos in positions[address]], causes, zero_copy)
        elif isinstance(res, PeerUnreachable):
            causes[address] = str(res)
            continue
        elif isinstance(res, BaseException):
            raise res
        it = iter(res)
        for pos in positions[address]:
            arrays = [next(it) for _ in fields]
            if all(a is not None for a in arrays):
                out[pos] = _assemble(metas[pos], fields, arrays, known, whole=token_ranges is None)
    lost = [m.sample_id for m, row in zip(metas, out) if row is None]
    if lost:
        raise SamplesUnavailable(lost, out, causes)
    return out  # type: ignore[return-value]  # no None left when nothing was lost


def pull_images(
    client: Puller, metas: Sequence[SampleMeta], token_ranges: Mapping[int, list[tuple[int, int]]] | None = None,
) -> list[tuple[SampleImage, ...]]:
    """The images of every meta whose spans meet its `token_ranges` (as in `pull_samples`; None: all of them),
    each pulled whole from its producer and checked (decoded, and against the row's crc32 when all were pulled).
    One request per producer. Raises `SamplesUnavailable` for samples whose producer is gone."""
    wanted: list[list[tuple[int, int, int]]] = []
    spans_of: list[list[list[int]]] = []
    for pos, meta in enumerate(metas):
        found = images_info(json.loads(meta.info_json))
        spans = found[0] if found else []
        ranges = None if token_ranges is None else token_ranges.get(pos, [])
        spans_of.append(spans)
        wanted.append(image_byte_ranges(spans, ranges))
    positions: dict[str, list[int]] = {}
    for pos, meta in enumerate(metas):
        if wanted[pos]:
            positions.setdefault(meta.producer_address, []).append(pos)
    requests = {addr: [(sample_key(metas[pos].sample_id, IMAGES), a, b) for pos in poss for _, a, b in wanted[pos]]
                for addr, poss in positions.items()}
    results = client.pull_many(requests, return_exceptions=True) if requests else {}
    out: list[tuple[SampleImage, ...]] = [() for _ in metas]
    lost: list[str] = []
    causes: dict[str, str] = {}
    for address, res in results.items():
        if isinstance(res, BaseException):
            if not isinstance(res, (PeerUnreachable, RemoteError)):
                raise res
            causes[address] = str(res)
            lost += [metas[pos].sample_id for pos in positions[address]]
            continue
        it = iter(res)
        for pos in positions[address]:
            parts = [bytes(np.ascontiguousarray(next(it)).view(np.uint8)) for _ in wanted[pos]]
            spans = spans_of[pos]
            if len(wanted[pos]) == len(spans):
                found = images_info(json.loads(metas[pos].info_json))
                if found is not None and zlib.crc32(b"".join(parts)) != found[1]:
                    raise StoreError(f"sample {metas[pos].sample_id}: its images do not match their checksum")
            pulled = [Image(png, spans[k][2], spans[k][3]) for (k, _, _), png in zip(wanted[pos], parts)]
            checked = received_images(pulled, f"producer {address}")
            out[pos] = tuple(SampleImage(spans[k][0], spans[k][1], img) for (k, _, _), img in zip(wanted[pos], checked))
    if lost:
        raise SamplesUnavailable(lost, [None] * len(metas), causes)
    return out


def _pull_one_by_one(
    client: Puller, address: str, per_sample: list[list[tuple[str, int, int]]], causes: dict[str, str], zero_copy: bool
) -> list[np.ndarray | None]:
    """Pull each sample's pieces separately (one array per field); a sample the peer no longer holds
    gives Nones."""
    flat: list[np.ndarray | None] = []
    for pieces in per_sample:
        fields = len({key for key, _, _ in pieces})
        try:
            flat.extend(client.pull(address, pieces, zero_copy=zero_copy, merge_runs=True))
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_KEY:
                raise
            causes.setdefault(address, f"peer {address} no longer holds some samples ({exc})")
            flat.extend([None] * fields)
        except PeerUnreachable as exc:
            causes[address] = str(exc)
            flat.extend([None] * fields)
    return flat


def _pieces_for(
    pos: int, meta: SampleMeta, fields: Sequence[str], token_ranges: Mapping[int, list[tuple[int, int]]] | None
) -> list[tuple[str, int, int]]:
    """The row's ranges of every field, field after field (an empty range if it needs none)."""
    ranges = _ranges_for(pos, meta, token_ranges) or [(0, 0)]
    out = []
    for name in fields:
        w = _width(meta, name)
        out += [(sample_key(meta.sample_id, name), s * w, e * w) for s, e in ranges]
    return out


def _width(meta: SampleMeta, name: str) -> int:
    """Stored elements per token of field `name` of this sample (layers x top_k for routed_experts)."""
    if name != ROUTED_EXPERTS:
        return 1
    found = routing_info(json.loads(meta.info_json))
    if found is None:
        raise StoreError(f"sample {meta.sample_id} has no {ROUTED_EXPERTS} (its engine recorded no routing)")
    return found[1]


def _routing_of(metas: Sequence[SampleMeta]) -> tuple[np.dtype, int]:
    """The one dtype and width of the routed_experts of these samples (StoreError if they differ)."""
    kinds = {(found[0], found[1]) for m in metas if (found := routing_info(json.loads(m.info_json))) is not None}
    if len(kinds) != 1:
        missing = [m.sample_id for m in metas if routing_info(json.loads(m.info_json)) is None]
        raise StoreError(f"{ROUTED_EXPERTS} cannot be pulled for these samples: "
                         f"{f'{len(missing)} have none' if missing else f'they disagree on dtype/width {sorted(kinds)}'}")
    return next(iter(kinds))


def _assemble(
    meta: SampleMeta, fields: Sequence[str], arrays: list[np.ndarray], known: Mapping[str, np.dtype], *, whole: bool
) -> dict[str, np.ndarray]:
    row = dict(zip(fields, arrays))  # one array per field: its ranges back to back
    if whole:
        _verify_row(meta, row, known)
    return row


def _ranges_for(pos: int, meta: SampleMeta, token_ranges: Mapping[int, list[tuple[int, int]]] | None) -> list[tuple[int, int]]:
    if token_ranges is None:
        return [(0, meta.total_tokens)]
    if pos not in token_ranges:
        raise StoreError(f"token_ranges has no entry for position {pos} (sample {meta.sample_id})")
    ranges: list[tuple[int, int]] = []
    for s, e in token_ranges[pos]:
        s, e = int(s), int(e)
        if not 0 <= s <= e <= meta.total_tokens:
            raise StoreError(f"range [{s}, {e}) outside sample {meta.sample_id} of {meta.total_tokens} tokens")
        if s == e:
            continue  # moves nothing
        if ranges and ranges[-1][1] == s:  # adjacent (e.g. the middle zig-zag chunks): one range, one piece
            ranges[-1] = (ranges[-1][0], e)
        else:
            ranges.append((s, e))
    return ranges


def _verify_row(meta: SampleMeta, row: Mapping[str, np.ndarray], known: Mapping[str, np.dtype]) -> None:
    for name, arr in row.items():
        n = meta.total_tokens * _width(meta, name)
        if arr.shape != (n,) or arr.dtype != known[name]:
            raise StoreError(
                f"sample {meta.sample_id}: {name} arrived as {arr.dtype}{list(arr.shape)}, "
                f"expected {known[name]}[{n}]"
            )
    if ROUTED_EXPERTS in row:
        found = routing_info(json.loads(meta.info_json))
        if found is not None and zlib.crc32(np.ascontiguousarray(row[ROUTED_EXPERTS]).view(np.uint8)) != found[2]:
            raise StoreError(f"sample {meta.sample_id} from {meta.producer_address}: {ROUTED_EXPERTS} does not match "
                             "its checksum; the producer's copy is corrupt: report the sample lost")
    if set(TOKEN_FIELDS) <= set(row) and record_checksum(row) != meta.checksum:
        raise StoreError(
            f"sample {meta.sample_id} from {meta.producer_address}: checksum of the pulled row does not match its "
            "metadata; the producer's copy is corrupt: report the sample lost"
        )
