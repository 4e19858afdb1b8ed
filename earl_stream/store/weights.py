"""Versioned model weights through the shard store.

Owns the key layout of published weights (`w/{version}/{name}` holding each tensor's raw bytes as a
uint8 array, plus `w/{version}/.manifest` holding a JSON `WeightsManifest` with dtype and shape per
tensor), `publish_weights` / `drop_weights` on the trainer's node, and `pull_weights` on a rollout
engine's side. All of a version's keys are put in one atomic `put_many`, so a puller sees a version
completely or not at all. `pull_weights_tp` pulls only a tensor-parallel engine's slice of each
tensor (`tp_split_dim`: column-parallel projections on dim 0, row-parallel on dim 1, embeddings and
lm_head on the vocabulary, norms replicated), as byte ranges of the stored tensors.

A tensor is published once however many names share it (`distinct_tensors`: a tied LM head is the
embedding's storage, so only `model.embed_tokens.weight` travels); an engine loading a state dict accepts
the missing alias (`engines.weight_swap.state_problems`; vLLM restores the head from the embedding).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import msgspec
import numpy as np
import torch

from earl_stream.errors import StoreError
from earl_stream.store.client import ShardClient
from earl_stream.store.node import ShardNode

MANIFEST_NAME = ".manifest"
_SUPERSEDED_CHECK_S = 1.0  # how often a wait for a version's manifest checks that no newer one is there
_POLL_S = (0.01, 0.5)  # first and largest wait between polls for a version not yet published
_S = TypeVar("_S", bound=msgspec.Struct)


class WeightEntry(msgspec.Struct, frozen=True):
    """One tensor, or one block of it: its name, torch dtype name (e.g. 'bfloat16'), shape, and size in
    bytes. A block (a trainer rank's shard) also names the whole tensor's `full_shape` and its `offset`
    in it; both are empty for a whole tensor."""

    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    full_shape: list[int] = []
    offset: list[int] = []


class WeightsManifest(msgspec.Struct, frozen=True):
    """What one node holds of a version; `peers`: the other nodes holding the rest of its blocks
    (the version is complete once every block of every peer is added)."""

    version: int
    tensors: list[WeightEntry]
    peers: list[str] = []

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


@dataclasses.dataclass(frozen=True)
class WeightPiece:
    """A block of tensor `name` held by this process: `tensor` sits at `offset` in the whole tensor
    of shape `full_shape` (a trainer rank's FSDP / tensor-parallel shard, or the whole tensor)."""

    name: str
    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def whole(self) -> bool:
        return tuple(self.tensor.shape) == self.full_shape


def _storage_key(value: torch.Tensor) -> tuple[object, ...] | None:
    """What identifies `value`'s elements in memory (its local shard for a DTensor); None where that cannot
    be told (empty or meta tensors), which never counts as shared."""
    local = value.to_local() if hasattr(value, "to_local") else value
    if local.numel() == 0 or local.is_meta:
        return None
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            local.stride(), local.dtype, tuple(value.shape))


def distinct_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every tensor once: a name whose tensor is a view of the same elements as an earlier
    name's (tied embeddings: `lm_head.weight` is `model.embed_tokens.weight`) is left out. The order is kept,
    so every rank of a pool drops the same names."""
    seen: set[tuple[object, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        key = _storage_key(value)
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        out[name] = value
    return out


def publish_weights(node: ShardNode, version: int, state: Mapping[str, torch.Tensor] | Sequence[WeightPiece], *,
                    peers: Sequence[str] = (), bucket_bytes: int = 64 << 20) -> WeightsManifest:
    """Snapshot `state` (whole tensors by name, each once: `distinct_tensors`; or this process's `WeightPiece`s)
    into `node` as version `version` (CPU copies taken now). `peers`: the nodes holding the version's other pieces.

    The copies go into the node `bucket_bytes` at a time (a larger tensor alone), so that the private
    copies alive at once stay within one bucket beside what the node holds; the manifest goes last, and
    a puller waits for it (`pull_weights`), so nobody reads a version before all of its pieces are in."""
    pieces = ([WeightPiece(k, v, tuple(v.shape), (0,) * v.dim()) for k, v in distinct_tensors(state).items()]
              if isinstance(state, Mapping) else list(state))
    items: dict[str, np.ndarray] = {}
    held = 0
    entries = []
    for piece in pieces:
        name, tensor = piece.name, piece.tensor
        if not name or name == MANIFEST_NAME:
            raise StoreError(f"weight name {name!r} is empty or reserved")
        # A copy: the trainer keeps updating its parameters in place after publishing.
        flat = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
        if items and held + raw.nbytes > bucket_bytes:
            node.put_many(items)
            items, held = {}, 0
        items[weight_key(version, name)] = raw
        held += raw.nbytes
        block = ([], []) if piece.whole else (list(piece.full_shape), list(piece.offset))
        entries.append(WeightEntry(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw.nbytes,
                                   *block))
    manifest = WeightsManifest(int(version), entries, list(peers))
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
    """Fetch version `version` (or only `names`) from the node at `address` and the peers its manifest
    names (concurrently), rebuilt with dtype and shape; blocks of one tensor are assembled.

    Waits for the version to be published, then pulls several tensors per request up to
    `bucket_bytes` (larger tensors in chunks). Everything is bounded by `timeout_s`; running out
    raises StoreError naming the version and the peer.
    """
    deadline = time.monotonic() + timeout_s
    wanted = None if names is None else set(names)
    where = f"weights version {version} from {address}"
    try:
        manifest = _await_manifest(client, address, version, deadline, where, timeout_s)
    except StoreError as exc:
        if where in str(exc):
            raise
        raise StoreError(f"pulling {where} failed: {exc}") from exc
    # rank 0's pieces and every peer's at once: each trainer rank's link carries only its own share
    with ThreadPoolExecutor(max_workers=min(16, 1 + len(manifest.peers))) as pool:
        futures = [pool.submit(_fetch_node, client, node, version, wanted, bucket_bytes, deadline, timeout_s,
                               manifest if node == address else None) for node in [address, *manifest.peers]]
        fetched = [f.result()[1] for f in futures]
    out = assemble_pieces(fetched)
    missing = [n for n in (names or []) if n not in out]
    if missing:
        raise StoreError(f"weights version {version} from {address} and its peers has no tensors {missing[:5]}")
    return out


def assemble_pieces(fetched: Iterable[Iterable[tuple[WeightEntry, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Whole tensors by name from (entry, tensor) pairs: whole tensors as they are, blocks of a tensor
    (`full_shape` set) copied into place in one new tensor of the full shape."""
    out: dict[str, torch.Tensor] = {}
    for pieces in fetched:
        for entry, tensor in pieces:
            if not entry.full_shape:
                out[entry.name] = tensor
                continue
            full = out.get(entry.name)
            if full is None:
                full = out[entry.name] = torch.empty(entry.full_shape, dtype=tensor.dtype)
            full[tuple(slice(o, o + n) for o, n in zip(entry.offset, entry.shape))] = tensor
    return out


def entry_tensor(entry: WeightEntry, raw: np.ndarray | None) -> torch.Tensor:
    """The tensor (or block) `entry` describes, viewed over its raw uint8 bytes `raw` (no copy)."""
    data = torch.from_numpy(raw) if entry.nbytes and raw is not None else torch.empty(0, dtype=torch.uint8)
    return data.view(_dtype_from_name(entry.dtype)).reshape(entry.shape)


def _fetch_node(client: ShardClient, address: str, version: int, names: set[str] | None, bucket_bytes: int,
                deadline: float, timeout_s: float, known: WeightsManifest | None = None,
                ) -> tuple[WeightsManifest, list[tuple[WeightEntry, torch.Tensor]]]:
    """What one node holds of `version`: its manifest (`known` if already read) and (entry, tensor) for
    each wanted tensor or block."""
    where = f"weights version {version} from {address}"
    try:
        manifest = known or _await_manifest(client, address, version, deadline, where, timeout_s)
        wanted = [e for e in manifest.tensors if names is None or e.name in names]
        raw = _pull_buckets(client, address, version, wanted, bucket_bytes, deadline, where, timeout_s)
    except StoreError as exc:
        if where in str(exc):
            raise
        raise StoreError(f"pulling {where} failed: {exc}") from exc
    return manifest, [(entry, entry_tensor(entry, raw.get(entry.name))) for entry in wanted]


def _remaining(deadline: float, where: str, timeout_s: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise StoreError(f"timed out after {timeout_s:g}s pulling {where}")
    return left


def _await_manifest(
    client: ShardClient, address: str, version: int, deadline: float, where: str, timeout_s: float
) -> WeightsManifest:
    return await_json(client, address, weight_key(version, MANIFEST_NAME), WeightsManifest, deadline, where, timeout_s)


def await_json(client: ShardClient, address: str, key: str, kind: type[_S], deadline: float, where: str,
               timeout_s: float, poll_s: tuple[float, float] = _POLL_S) -> _S:
    """Wait until the node at `address` holds `key` (polling its manifest), then decode it as JSON `kind`.

    A versioned manifest key (`PREFIX{version}/.manifest`) is given up at once, not at the deadline, when
    the node already serves a newer version's manifest under the same prefix: that version will never come
    (a trainer keeps its last two; a worker that asked for an old one must ask for the current one)."""
    wait = poll_s[0]
    family = _version_family(key)
    next_check = time.monotonic() + _SUPERSEDED_CHECK_S
    while True:
        entries = client.manifest(address, key, timeout_s=_remaining(deadline, where, timeout_s))
        match = [e for e in entries if e.key == key]
        if match:
            break
        if deadline - time.monotonic() <= wait:
            raise StoreError(f"timed out after {timeout_s:g}s waiting for {where}: not published there")
        if family is not None and time.monotonic() >= next_check:
            newest = _newest_version(client, address, family[0], _remaining(deadline, where, timeout_s))
            if newest is not None and newest > family[1]:
                raise StoreError(f"superseded: version {newest} of it is published at {address} already")
            next_check = time.monotonic() + _SUPERSEDED_CHECK_S
        time.sleep(wait)
        wait = min(wait * 2, poll_s[1])
    (blob,) = client.pull(address, [(key, 0, match[0].shape[0])], timeout_s=_remaining(deadline, where, timeout_s))
    try:
        return msgspec.json.decode(blob.tobytes(), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StoreError(f"{where}: unreadable manifest {key}: {exc}") from exc


def _version_family(key: str) -> tuple[str, int] | None:
    """('w/', 7) for 'w/7/.manifest': the prefix versions of the same kind share, and the version."""
    prefix, _, rest = key.partition("/")
    version, _, name = rest.partition("/")
    return (prefix + "/", int(version)) if name == MANIFEST_NAME and version.isdigit() else None


def _newest_version(client: ShardClient, address: str, prefix: str, timeout_s: float) -> int | None:
    versions = [int(v) for e in client.manifest(address, prefix, timeout_s=timeout_s)
                if (v := e.key[len(prefix):].partition("/")[0]).isdigit() and e.key.endswith("/" + MANIFEST_NAME)]
    return max(versions, default=None)


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
        if manifest.peers or any(e.full_shape for e in manifest.tensors):
            raise StoreError(f"{where} is published in blocks by several trainer ranks: pull it with pull_weights")
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
