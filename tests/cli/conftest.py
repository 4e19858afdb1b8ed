"""`ray_cluster`: a real three-node Ray cluster on this host (tests/ray_cluster.py), for the tests marked
`ray`; they skip where ray is not installed (`make test-ray` builds .venv-ray)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from ray_cluster import HEAD, TRAINER_NODES


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="ray is not installed (make test-ray)")
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args=HEAD)
    for node in TRAINER_NODES:
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
