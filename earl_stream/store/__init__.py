"""The experience store's data plane: shard nodes, pulls, layouts, sample metadata and weights.

Tensor bytes stay in the process that produced them (a `ShardNode`); metadata rows (`SampleMeta`,
Arrow `METADATA_SCHEMA`) go to the supervisor, which is not part of this package. Consumers compute
their share with `partition` and pull it with `pull_samples` / `pull_weights` through a `ShardClient`
(shared memory with same-host peers, UCX when `ucxx` is installed and chosen, TCP otherwise). `store.dispatch=central` routes the same pulls
through one `CentralDispatcher` process instead (`CentralClient`, `pull_samples_central`).
"""

from __future__ import annotations

from typing import Any

from earl_stream.store.central import CentralClient, CentralDispatcher, DispatcherProcess, pull_samples_central, start_dispatcher_process
from earl_stream.store.client import PeerUnreachable, RemoteError, ShardClient
from earl_stream.store.experience import ExperienceWriter, Puller, SamplesUnavailable, pull_samples, record_checksum
from earl_stream.store.layout import Layout, Partition, partition
from earl_stream.store.node import ShardNode
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
from earl_stream.store.shm import cleanup_stale_segments, shm_supported
from earl_stream.store.wire import ErrorCode, ManifestEntry

# weights.py needs torch; load it on first use so that torch-free processes (the supervisor) stay light.
_LAZY_WEIGHTS = frozenset(
    {"WeightEntry", "WeightsManifest", "drop_weights", "publish_weights", "pull_weights", "pull_weights_tp", "tp_bounds", "tp_split_dim"}
)


def __getattr__(name: str) -> Any:
    if name in _LAZY_WEIGHTS:
        from earl_stream.store import weights

        return getattr(weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "METADATA_SCHEMA",
    "SCHEMA_VERSION",
    "CentralClient",
    "CentralDispatcher",
    "DispatcherProcess",
    "ErrorCode",
    "ExperienceWriter",
    "Layout",
    "ManifestEntry",
    "Partition",
    "PeerUnreachable",
    "Puller",
    "RemoteError",
    "SampleMeta",
    "SamplesUnavailable",
    "ShardClient",
    "ShardNode",
    "WeightEntry",
    "WeightsManifest",
    "cleanup_stale_segments",
    "drop_weights",
    "metas_to_table",
    "partition",
    "publish_weights",
    "pull_samples",
    "pull_samples_central",
    "pull_weights",
    "pull_weights_tp",
    "record_checksum",
    "sample_key",
    "shm_supported",
    "start_dispatcher_process",
    "table_from_ipc",
    "table_to_ipc",
    "table_to_metas",
    "tp_bounds",
    "tp_split_dim",
]
