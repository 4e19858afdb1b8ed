"""Weight versions relayed between rollout workers (`store.weight_sync=relay`).

Owns the relay stream of a version on a rollout worker's shard node (`wr/{version}/.manifest`: a
JSON `RelayManifest`; `wr/{version}/{i}`: the raw bytes of chunk i), `pull_weights_relay` (pull a
version chunk by chunk from a worker that holds or is pulling it, or from the trainer ranks when none
is named, and serve each chunk from this worker's node as soon as it is in) and `sync_weights` (a
pull as the supervisor routed it). What the trainer publishes and the direct pull are `weights.py`'s;
whom each worker pulls from is `weight_route.py`'s, told by the supervisor (`HeartbeatReply`).

Why a chain of chunks: each host receives the model once and sends it at most once, so a version
reaches N hosts in about one model's transfer time plus N - 1 chunk times, while N direct pulls make
the trainer ranks' links carry N copies. A worker whose relay peer fails or stalls fetches the chunks
it still lacks from the trainer ranks, whose addresses every relay manifest carries.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import torch

from earl_stream.errors import StoreError
from earl_stream.store.client import ShardClient
from earl_stream.store.node import ShardNode
from earl_stream.store.weight_route import WeightRoute
from earl_stream.store.weights import (
    MANIFEST_NAME,
    WeightEntry,
    WeightsManifest,
    assemble_pieces,
    await_json,
    entry_tensor,
    pull_weights,
    weight_key,
)

log = logging.getLogger(__name__)
RELAY_PREFIX = "wr/"
_FOLLOW_POLL_S = (0.001, 0.005)  # a relay peer's next chunk is one chunk time away: poll tightly
_FOLLOW_BATCH = 1  # chunks per request to a relay peer (a chunk is served onwards once its whole request is in)
_FOLLOW_STREAMS = 2  # connections a worker pulls from its relay peer over at once


class RelayChunk(msgspec.Struct, frozen=True, array_like=True):
    """Bytes [start, end) of tensor entry `entry` (an index into `RelayManifest.tensors`), held by trainer
    node `source` (an index into `RelayManifest.sources`) under `weight_key(version, name)`."""

    source: int
    entry: int
    start: int
    end: int


class RelayManifest(msgspec.Struct, frozen=True):
    """A version as a relay serves it: every trainer rank's entries (whole tensors or blocks) and the
    chunks they are cut into; the same on every worker of a chain (the first one plans it)."""

    version: int
    sources: list[str]
    tensors: list[WeightEntry]
    chunks: list[RelayChunk]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def relay_key(version: int, name: str) -> str:
    return f"{RELAY_PREFIX}{int(version)}/{name}"


def sync_weights(client: ShardClient, node: ShardNode, address: str, version: int, route: WeightRoute, *,
                 timeout_s: float = 60.0) -> dict[str, torch.Tensor]:
    """A rollout worker's pull of `version` as the supervisor routed it (`weight_route`): relayed (and
    served onwards from `node`), or straight from the trainer ranks at `address`."""
    if route.relay:
        return pull_weights_relay(client, node, address, version, via=route.via, timeout_s=timeout_s)
    return pull_weights(client, address, version, timeout_s=timeout_s)


def pull_weights_relay(
    client: ShardClient,
    node: ShardNode,
    address: str,
    version: int,
    *,
    via: str = "",
    timeout_s: float = 60.0,
    chunk_bytes: int = 4 << 20,
    stall_s: float = 10.0,
    keep_versions: int = 2,
) -> dict[str, torch.Tensor]:
    """Fetch version `version` published at trainer node `address` (and its peers), serving it from `node`
    as it arrives: every chunk is put under `relay_key(version, i)` right after it is pulled, so workers
    that name this node as `via` pull from here instead of from the trainer.

    `via`: a worker's shard node to pull from (it holds or is pulling the version); "" pulls from the
    trainer ranks (the head of a chain). If `via` has no plan of the version within `stall_s`, gets no
    new chunk for `stall_s`, or fails, the chunks still missing come from the trainer ranks. Versions
    older than the last `keep_versions` are dropped from `node`. Returns whole tensors as `pull_weights`
    does (a tensor of one chunk shares its bytes with the node's copy: do not write to it).
    """
    if chunk_bytes < 1 or keep_versions < 1:
        raise StoreError(f"chunk_bytes={chunk_bytes} and keep_versions={keep_versions} must be >= 1")
    deadline = time.monotonic() + timeout_s
    _drop_older(node, version - keep_versions + 1)
    node.drop_prefix(relay_key(version, ""))  # a retry of this version starts its stream again
    manifest = _relay_plan(client, via, version, min(stall_s, timeout_s)) if via else None
    if manifest is None:
        manifest = plan_relay(client, address, version, chunk_bytes, deadline, timeout_s)
    node.put(relay_key(version, MANIFEST_NAME), np.frombuffer(msgspec.json.encode(manifest), np.uint8).copy())
    raw: dict[int, np.ndarray] = {}
    if via:
        try:
            _follow(client, node, via, manifest, raw, deadline, stall_s)
        except StoreError as exc:
            log.warning("relay of weights version %d from %s failed (%s); the %d chunks left come from the trainer",
                        version, via, exc, len(manifest.chunks) - len(raw))
    _fetch_from_sources(client, node, manifest, raw, deadline, timeout_s)
    return _assemble(manifest, raw)


def plan_relay(client: ShardClient, address: str, version: int, chunk_bytes: int, deadline: float,
               timeout_s: float) -> RelayManifest:
    """The relay manifest of a version published at `address`: its manifest and its peers', cut into
    chunks of at most `chunk_bytes`. Waits (up to `deadline`) for the version to be published."""
    where = f"weights version {version} from {address}"
    first = await_json(client, address, weight_key(version, MANIFEST_NAME), WeightsManifest, deadline, where, timeout_s)
    manifests = [first]
    if first.peers:
        with ThreadPoolExecutor(max_workers=min(16, len(first.peers))) as pool:
            manifests += list(pool.map(lambda peer: await_json(
                client, peer, weight_key(version, MANIFEST_NAME), WeightsManifest, deadline,
                f"weights version {version} from {peer}", timeout_s), first.peers))
    tensors: list[WeightEntry] = []
    chunks: list[RelayChunk] = []
    for source, manifest in enumerate(manifests):
        for entry in manifest.tensors:
            chunks += [RelayChunk(source, len(tensors), s, min(s + chunk_bytes, entry.nbytes))
                       for s in range(0, entry.nbytes, chunk_bytes)]
            tensors.append(entry)
    return RelayManifest(int(version), [address, *first.peers], tensors, chunks)


def _relay_plan(client: ShardClient, via: str, version: int, wait_s: float) -> RelayManifest | None:
    where = f"the relay of weights version {version} at {via}"
    try:
        return await_json(client, via, relay_key(version, MANIFEST_NAME), RelayManifest, time.monotonic() + wait_s,
                          where, wait_s, poll_s=_FOLLOW_POLL_S)
    except StoreError as exc:
        log.warning("%s: %s; pulling from the trainer instead", where, exc)
        return None


def _follow(client: ShardClient, node: ShardNode, via: str, manifest: RelayManifest, raw: dict[int, np.ndarray],
            deadline: float, stall_s: float) -> None:
    """Pull each chunk from `via` once it holds it and put it into `node`, until all are here.

    `_FOLLOW_STREAMS` connections to `via`, each pulling batches of up to `_FOLLOW_BATCH` of the chunks
    `via` lists: while one stream waits for its request to start, or lists, or stores what it got, the
    other's reply keeps the link busy (one stream left ~10% of the link idle, and each worker of a chain
    fell further behind the one before it). Larger batches would delay the next worker of the chain: a
    chunk is served onwards once its whole batch is in. A key is only asked for once listed, so `via`
    never refuses a request.
    """
    follow = _Follow(manifest, raw, time.monotonic())
    clients = [client] + [client.sibling() for _ in range(_FOLLOW_STREAMS - 1)]
    try:
        with ThreadPoolExecutor(max_workers=len(clients)) as pool:
            futures = [pool.submit(follow.stream, c, node, via, deadline, stall_s) for c in clients]
            errors = [f.exception() for f in futures]
    finally:
        for extra in clients[1:]:
            extra.close()
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise failed if isinstance(failed, StoreError) else StoreError(f"relay from {via}: {failed!r}")


class _Follow:
    """What the streams of one `_follow` share: chunks listed at the peer, claimed by a stream, and in."""

    def __init__(self, manifest: RelayManifest, raw: dict[int, np.ndarray], now: float) -> None:
        self.manifest, self.raw = manifest, raw
        self.listed: set[int] = set()
        self.claimed: set[int] = set()
        self.last_progress = now
        self.failed = threading.Event()
        self.lock = threading.Lock()

    def _claim(self) -> list[int] | None:
        """Up to `_FOLLOW_BATCH` listed chunks nobody has claimed; [] when none is listed; None when done."""
        with self.lock:
            if self.failed.is_set() or len(self.raw) == len(self.manifest.chunks):
                return None
            batch = sorted(self.listed - self.claimed)[:_FOLLOW_BATCH]
            self.claimed.update(batch)
            return batch

    def stream(self, client: ShardClient, node: ShardNode, via: str, deadline: float, stall_s: float) -> None:
        version = self.manifest.version
        prefix = relay_key(version, "")
        wait = _FOLLOW_POLL_S[0]
        try:
            while (batch := self._claim()) is not None:
                now = time.monotonic()
                if not batch:
                    if now > deadline or now - self.last_progress > stall_s:
                        raise StoreError(f"no new chunk from {via} for {now - self.last_progress:.1f}s "
                                         f"({len(self.manifest.chunks) - len(self.raw)} left)")
                    present = {e.key for e in client.manifest(via, prefix, timeout_s=max(deadline - now, 0.001))}
                    with self.lock:
                        new = {i for i in range(len(self.manifest.chunks))
                               if i not in self.listed and relay_key(version, str(i)) in present}
                        self.listed |= new
                    if not new:
                        time.sleep(wait)
                        wait = min(wait * 2, _FOLLOW_POLL_S[1])
                    continue
                keys = [relay_key(version, str(i)) for i in batch]
                chunks = [self.manifest.chunks[i] for i in batch]
                arrays = client.pull(via, [(k, 0, c.end - c.start) for k, c in zip(keys, chunks)],
                                     timeout_s=max(deadline - time.monotonic(), 0.001))
                node.put_many(dict(zip(keys, arrays)))
                with self.lock:
                    self.raw.update(zip(batch, arrays))
                    self.last_progress = time.monotonic()
                wait = _FOLLOW_POLL_S[0]
        except BaseException:
            self.failed.set()  # the other streams stop; the chunks not in come from the trainer ranks
            raise


def _fetch_from_sources(client: ShardClient, node: ShardNode, manifest: RelayManifest, raw: dict[int, np.ndarray],
                        deadline: float, timeout_s: float) -> None:
    """Pull every chunk not in `raw` from the trainer node holding it (one thread per node), chunk by chunk."""
    by_source: dict[int, list[int]] = {}
    for i, chunk in enumerate(manifest.chunks):
        if i not in raw:
            by_source.setdefault(chunk.source, []).append(i)

    def fetch(source: int) -> None:
        address = manifest.sources[source]
        for i in by_source[source]:
            chunk = manifest.chunks[i]
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(f"timed out after {timeout_s:g}s pulling weights version {manifest.version} from {address}")
            name = manifest.tensors[chunk.entry].name
            (arr,) = client.pull(address, [(weight_key(manifest.version, name), chunk.start, chunk.end)], timeout_s=left)
            node.put(relay_key(manifest.version, str(i)), arr)
            raw[i] = arr

    if by_source:
        with ThreadPoolExecutor(max_workers=min(16, len(by_source))) as pool:
            for future in [pool.submit(fetch, s) for s in by_source]:
                future.result()


def _assemble(manifest: RelayManifest, raw: dict[int, np.ndarray]) -> dict[str, torch.Tensor]:
    parts: list[list[np.ndarray]] = [[] for _ in manifest.tensors]
    for i, chunk in enumerate(manifest.chunks):  # chunks of an entry are listed in byte order
        parts[chunk.entry].append(raw[i])
    pieces = []
    for entry, chunks in zip(manifest.tensors, parts):
        data = None if not chunks else chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        if entry.nbytes and (data is None or data.nbytes != entry.nbytes):
            raise StoreError(f"relay of weights version {manifest.version}: {entry.name} has "
                             f"{0 if data is None else data.nbytes} of {entry.nbytes} bytes")
        pieces.append((entry, entry_tensor(entry, data)))
    return assemble_pieces([pieces])


def _drop_older(node: ShardNode, oldest_kept: int) -> None:
    """Drop the relay streams of versions before `oldest_kept` from `node`."""
    versions = {k[len(RELAY_PREFIX):].split("/", 1)[0] for k in node.keys() if k.startswith(RELAY_PREFIX)}
    for v in versions:
        if v.isdigit() and int(v) < oldest_kept:
            node.drop_prefix(relay_key(int(v), ""))
