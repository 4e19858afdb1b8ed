"""Versioned model weights through the shard store.

Owns the key layout of published weights (`w/{version}/{name}` holding each tensor's raw bytes as a
uint8 array, plus `w/{version}/.manifest` holding a JSON `WeightsManifest` with dtype and shape per
tensor), `publish_weights` / `drop_weights` on the trainer's node, and `pull_weights` on a rollout
engine's side. All of a version's keys are put in one atomic `put_many`, so a puller sees a version
completely or not at all. `pull_weights_tp` pulls only a tensor-parallel engine's slice of each
tensor (`tp_split_dim`: column-parallel projections on dim 0, row-parallel on dim 1, embeddings and
lm_head on the vocabulary, norms replicated), as byte ranges of the stored tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import msgspec
import numpy as np
import torch

from earl_stream.errors import StoreError
from earl_stream.store.client import ShardClient
from earl_stream.store.node import ShardNode

MANIFEST_NAME = ".manifest"
_POLL_S = (0.01, 0.5)  # first and largest wait between polls for a version not yet published


class WeightEntry(msgspec.Struct, frozen=True):
    """One tensor: its name, torch dtype name (e.g. 'bfloat16'), shape, and size in bytes."""

    name: str
    dtype: str
    shape: list[int]
    nbytes: int


class WeightsManifest(msgspec.Struct, frozen=True):
    version: int
    tensors: list[WeightEntry]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def weights_prefix(version: int) -> str:
    return f"w/{int(version)}/"


def weight_key(version: int, name: str) -> str:
    return f"{weights_prefix(version)}{name}"


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StoreError(f"unknown torch dtype {name!r} in a weights manifest")
    return dtype


def publish_weights(node: ShardNode, version: int, state: Mapping[str, torch.Tensor]) -> WeightsManifest:
    """Snapshot `state` (any dtypes and shapes, CPU copies taken now) into `node` as version `version`."""
    items: dict[str, np.ndarray] = {}
    entries = []
    for name, tensor in state.items():
        if not name or name == MANIFEST_NAME:
            raise StoreError(f"weight name {name!r} is empty or reserved")
        # A copy: the trainer keeps updating its parameters in place after publishing.
        flat = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
        items[weight_key(version, name)] = raw
        entries.append(WeightEntry(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw.nbytes))
    manifest = WeightsManifest(int(version), entries)
    items[weight_key(version, MANIFEST_NAME)] = np.frombuffer(msgspec.json.encode(manifest), np.uint8).copy()
    node.put_many(items)
    return manifest


def drop_weights(node: ShardNode, version: int) -> int:
    """Free every shard of `version`; returns bytes freed."""
    return node.drop_prefix(weights_prefix(version))


def pull_weights(
    client: ShardClient,
    address: str,
    version: int,
    *,
    timeout_s: float = 60.0,
    names: Iterable[str] | None = None,
    bucket_bytes: int = 64 << 20,
) -> dict[str, torch.Tensor]:
    """Fetch version `version` (or only `names`) from the node at `address`, rebuilt with dtype and shape.

    Waits for the version to be published, then pulls several tensors per request up to
    `bucket_bytes` (larger tensors in chunks). Everything is bounded by `timeout_s`; running out
    raises StoreError naming the version and the peer.
    """
    deadline = time.monotonic() + timeout_s
    where = f"weights version {version} from {address}"
    try:
        manifest = _await_manifest(client, address, version, deadline, where, timeout_s)
        wanted = _select(manifest, names, where)
        raw = _pull_buckets(client, address, version, wanted, bucket_bytes, deadline, where, timeout_s)
    except StoreError as exc:
        if where in str(exc):
            raise
        raise StoreError(f"pulling {where} failed: {exc}") from exc
    out = {}
    for entry in wanted:
        data = torch.from_numpy(raw[entry.name]) if entry.nbytes else torch.empty(0, dtype=torch.uint8)
        out[entry.name] = data.view(_dtype_from_name(entry.dtype)).reshape(entry.shape)
    return out


def _remaining(deadline: float, where: str, timeout_s: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise StoreError(f"timed out after {timeout_s:g}s pulling {where}")
    return left


def _await_manifest(
    client: ShardClient, address: str, version: int, deadline: float, where: str, timeout_s: float
) -> WeightsManifest:
    key = weight_key(version, MANIFEST_NAME)
    wait = _POLL_S[0]
    while True:
        entries = client.manifest(address, key, timeout_s=_remaining(deadline, where, timeout_s))
        match = [e for e in entries if e.key == key]
        if match:
            break
        if deadline - time.monotonic() <= wait:
            raise StoreError(f"timed out after {timeout_s:g}s waiting for {where}: not published there")
        time.sleep(wait)
        wait = min(wait * 2, _POLL_S[1])
    (blob,) = client.pull(address, [(key, 0, match[0].shape[0])], timeout_s=_remaining(deadline, where, timeout_s))
    try:
        return msgspec.json.decode(blob.tobytes(), type=WeightsManifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StoreError(f"{where}: unreadable weights manifest: {exc}") from exc


def _select(manifest: WeightsManifest, names: Iterable[str] | None, where: str) -> list[WeightEntry]:
    if names is None:
        return list(manifest.tensors)
    by_name = {e.name: e for e in manifest.tensors}
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise StoreError(f"{where} has no tensors {missing[:5]}; it holds {len(by_name)} others")
    return [by_name[n] for n in wanted]


def _pull_buckets(
    client: ShardClient,
    address: str,
    version: int,
    entries: list[WeightEntry],
    bucket_bytes: int,
    deadline: float,
    where: str,
    timeout_s: float,
) -> dict[str, np.ndarray]:
    """Raw uint8 bytes per tensor name; each request carries at most `bucket_bytes` (but >= 1 chunk)."""
    if bucket_bytes < 1:
        raise StoreError(f"bucket_bytes={bucket_bytes} must be >= 1")
    buckets: list[list[tuple[str, int, int]]] = [[]]  # (name, start byte, end byte)
    fill = 0
    for entry in entries:
        for start in range(0, entry.nbytes, bucket_bytes):
            end = min(start + bucket_bytes, entry.nbytes)
            if fill and fill + end - start > bucket_bytes:
                buckets.append([])
                fill = 0
            buckets[-1].append((entry.name, start, end))
            fill += end - start
    chunks: dict[str, list[np.ndarray]] = {e.name: [] for e in entries}
    for bucket in buckets:
        if not bucket:
            continue
        pieces = [(weight_key(version, name), s, e) for name, s, e in bucket]
        arrays = client.pull(address, pieces, timeout_s=_remaining(deadline, where, timeout_s))
        for (name, _, _), arr in zip(bucket, arrays):
            chunks[name].append(arr)
    return {name: (c[0] if len(c) == 1 else np.concatenate(c)) for name, c in chunks.items() if c}


# --- tensor-parallel slices -------------------------------------------------------------------------------

# Megatron-style sharding of a transformer's parameters (Hugging Face names): column-parallel
# projections split their output features (dim 0 of the [out, in] weight, and their bias),
# row-parallel ones their input features (dim 1; their bias is replicated), embeddings and the output
# head their vocabulary (dim 0); everything else (norms, scalars) is replicated.
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB_PARALLEL = ("embed_tokens", "lm_head", "wte")
_MAX_PIECES_PER_REQUEST = 16384  # keeps a request header far below wire.MAX_HEADER_BYTES


def tp_split_dim(name: str, shape: list[int]) -> int | None:
    """The dimension along which tensor-parallel ranks split parameter `name` (None: replicated).

    q/k/v/gate/up projections: 0 (weight [out, in] and bias [out]); o/down projections: 1 for the
    weight [out, in] (bias replicated); embeddings and lm_head: 0 (vocabulary); norms and the rest: None.
    """
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    leaf = parts[-1]
    if module in _COLUMN_PARALLEL and len(shape) >= 1:
        return 0
    if module in _ROW_PARALLEL and leaf == "weight" and len(shape) == 2:
        return 1
    if module in _VOCAB_PARALLEL and leaf == "weight" and len(shape) == 2:
        return 0
    return None


def tp_bounds(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of rank `tp_rank`'s share of `size` (near-equal contiguous shares, in rank order)."""
    return size * tp_rank // tp_size, size * (tp_rank + 1) // tp_size


def pull_weights_tp(
    client: ShardClient,
    address: str,
    version: int,
    tp_rank: int,
    tp_size: int,
    *,
    timeout_s: float = 60.0,
    names: Iterable[str] | None = None,
    bucket_bytes: int = 64 << 20,
    split_dim: Callable[[str, list[int]], int | None] = tp_split_dim,
) -> dict[str, torch.Tensor]:
    """Fetch only tensor-parallel slice `tp_rank` of `tp_size` of every tensor of version `version`.

    A tensor split along dim d (see `tp_split_dim`; d in {0, 1}) comes back with `tp_bounds(shape[d],
    ...)` of that dimension, the others whole; replicated tensors whole. Only those bytes move: a dim-0
    slice is one byte range, a dim-1 slice one range per row. Requests carry at most `bucket_bytes`;
    everything is bounded by `timeout_s` (StoreError naming the version and the peer, never a hang).
    """
    if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise StoreError(f"tp_rank={tp_rank!r} must be in [0, tp_size={tp_size!r})")
    if bucket_bytes < 1:
        raise StoreError(f"bucket_bytes={bucket_bytes} must be >= 1")
    deadline = time.monotonic() + timeout_s
    where = f"weights version {version} (tp slice {tp_rank}/{tp_size}) from {address}"
    try:
        manifest = _await_manifest(client, address, version, deadline, where, timeout_s)
        wanted = _select(manifest, names, where)
        plans = [_slice_plan(e, split_dim(e.name, list(e.shape)), tp_rank, tp_size, where) for e in wanted]
        raw = _pull_ranges(client, address, version, plans, bucket_bytes, deadline, where, timeout_s)
    except StoreError as exc:
        if where in str(exc):
            raise
        raise StoreError(f"pulling {where} failed: {exc}") from exc
    out = {}
    for entry, (_, shape, _) in zip(wanted, plans):
        data = raw.get(entry.name)
        tensor = torch.from_numpy(data) if data is not None and data.size else torch.empty(0, dtype=torch.uint8)
        out[entry.name] = tensor.view(_dtype_from_name(entry.dtype)).reshape(shape)
    return out


def _slice_plan(
    entry: WeightEntry, dim: int | None, tp_rank: int, tp_size: int, where: str
) -> tuple[str, list[int], list[tuple[int, int]]]:
    """(name, shape of the slice, byte ranges of the stored tensor that make it up, in order)."""
    shape = list(entry.shape)
    if dim is None or tp_size == 1:
        return entry.name, shape, [(0, entry.nbytes)] if entry.nbytes else []
    if dim not in (0, 1) or dim >= len(shape):
        raise StoreError(f"{where}: cannot split {entry.name} {shape} along dim {dim} (only 0 or 1)")
    numel = int(np.prod(shape))
    item = entry.nbytes // numel if numel else 0
    start, end = tp_bounds(shape[dim], tp_rank, tp_size)
    sliced = shape[:dim] + [end - start] + shape[dim + 1 :]
    inner = int(np.prod(shape[dim + 1 :])) * item  # bytes per index of `dim`
    if dim == 0:
        return entry.name, sliced, [(start * inner, end * inner)] if end > start and inner else []
    row = shape[1] * inner
    ranges = [(r * row + start * inner, r * row + end * inner) for r in range(shape[0])] if end > start and inner else []
    return entry.name, sliced, ranges


def _pull_ranges(
    client: ShardClient,
    address: str,
    version: int,
    plans: list[tuple[str, list[int], list[tuple[int, int]]]],
    bucket_bytes: int,
    deadline: float,
    where: str,
    timeout_s: float,
) -> dict[str, np.ndarray]:
    """Raw uint8 bytes per tensor name (its ranges back to back), in requests of <= `bucket_bytes`."""
    buckets: list[list[tuple[str, int, int]]] = [[]]
    fill = 0
    for name, _, ranges in plans:
        for lo, hi in ranges:
            for s in range(lo, hi, bucket_bytes):
                e = min(s + bucket_bytes, hi)
                if buckets[-1] and (fill + e - s > bucket_bytes or len(buckets[-1]) >= _MAX_PIECES_PER_REQUEST):
                    buckets.append([])
                    fill = 0
                buckets[-1].append((name, s, e))
                fill += e - s
    chunks: dict[str, list[np.ndarray]] = {}
    for bucket in buckets:
        if not bucket:
            continue
        pieces = [(weight_key(version, name), s, e) for name, s, e in bucket]
        arrays = client.pull(address, pieces, timeout_s=_remaining(deadline, where, timeout_s), merge_runs=True)
        names = [name for i, (name, _, _) in enumerate(bucket) if i == 0 or bucket[i - 1][0] != name]
        for name, arr in zip(names, arrays):
            chunks.setdefault(name, []).append(arr)
    return {name: (c[0] if len(c) == 1 else np.concatenate(c)) for name, c in chunks.items()}
