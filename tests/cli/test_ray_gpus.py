"""`up --launcher ray` places its processes on GPUs through Ray's own GPU resource (launcher.gpus, cli/launchers/
gpus.py): on a Ray node that declares 4 GPUs this host does not have, each trainer rank and each rollout worker
runs with the CUDA_VISIBLE_DEVICES Ray gave its actor, read from the process itself (/proc/PID/environ of the
pid it registered with), and still computes on the CPU, since torch here has no CUDA. Split with a GPU for each
(2 ranks + 2 workers on 4), and with 3 workers on the 2 GPUs the ranks leave (two of them share one). Skipped
where ray is not installed: `make test-ray` runs it in .venv-ray."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import wait_for
from ray_cluster import GPU_NODE

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.security.secret import load_secret

pytestmark = [pytest.mark.slow, pytest.mark.ray]
STEPS = 2


@pytest.fixture(scope="module")
def ray_gpu_node() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="ray is not installed (make test-ray)")
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args=GPU_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        assert ray.cluster_resources().get("GPU") == 4.0
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _status(run: Path) -> dict[str, Any]:
    ready = run / "supervisor.json"
    if not ready.exists():
        return {}
    client = P.ControlClient(json.loads(ready.read_text())["address"], timeout_s=5, secret=load_secret(str(run / "secret")),
                             encrypt=load_config(str(run / "config.yaml")).security.encrypt)  # on across hosts
    try:
        return json.loads(client.call(P.StatusRequest()).status_json)
    finally:
        client.close()


def _visible_devices(pid: int) -> str | None:
    """CUDA_VISIBLE_DEVICES in the environment process `pid` runs with."""
    env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
    value = env.get(b"CUDA_VISIBLE_DEVICES")
    return None if value is None else value.decode()


@pytest.mark.parametrize("workers", [2, 3])
def test_up_on_ray_gives_each_rank_and_rollout_worker_its_gpus(tmp_path: Path, tiny_model_dir: Path,
                                                               ray_gpu_node: Any, workers: int) -> None:
    started = time.monotonic()
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--launcher", "ray", "--ray-address", ray_gpu_node.address,
           "--steps", "0", "--summary", str(tmp_path / "s.json"), f"model.path={tiny_model_dir}", f"run_dir={run}",
           "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2", f"rollout.workers={workers}",
           "trainer.nproc=2", "supervisor.heartbeat_s=0.2", "launcher.ray.placement_timeout_s=30",
           "launcher.ray.supervisor.num_cpus=0.5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        def registered() -> list[dict[str, Any]]:
            st = _status(run)
            alive = [w for w in st.get("workers", []) if w["alive"]]
            roles = collections.Counter(w["role"] for w in alive)
            done = roles == {"trainer": 2, "rollout": workers} and st.get("policy_version", 0) >= STEPS
            return alive if done else []

        processes = wait_for(registered, 300, f"2 trainer ranks, {workers} rollout workers and {STEPS} steps")
        seen = {(w["role"], w["id"]): _visible_devices(w["pid"]) for w in processes}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=180)[0]
    print(f"ray gpus run ({workers} workers): {time.monotonic() - started:.0f}s, CUDA_VISIBLE_DEVICES {seen}")
    assert proc.returncode == 0, out[-4000:]
    ranks = [v for (role, _), v in seen.items() if role == "trainer"]
    rollout = [v for (role, _), v in seen.items() if role == "rollout"]
    assert all(v is not None and v in "0123" and len(v) == 1 for v in ranks + rollout), seen  # one GPU each
    assert len(set(ranks)) == 2, seen  # a GPU of its own for each rank ...
    assert not set(ranks) & set(rollout), seen  # ... that no rollout worker shares
    if workers == 2:
        assert len(set(rollout)) == 2, seen  # each worker its own
        assert "each trainer rank reserves 1, each rollout worker 1" in out, out[-3000:]
    else:  # 3 workers on the 2 GPUs left: two share one (0.5 GPU each)
        assert sorted(collections.Counter(rollout).values()) == [1, 2], seen
        assert "each trainer rank reserves 1, each rollout worker 0.5" in out, out[-3000:]
    logs = run / "logs"
    for r in range(2):  # the devices torch sees decide, not CUDA_VISIBLE_DEVICES: no CUDA here, so the CPU
        assert f"trainer rank {r} computes on cpu" in (logs / f"trainer-{r}.log").read_text()
    for i in range(workers):
        assert "built-in engine generates on cpu" in (logs / f"rollout-{i}.log").read_text()
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["policy_version"] >= STEPS and s["duplicates_detected"] == 0, s


def test_ranks_that_would_share_gpus_with_workers_fail_at_start(tmp_path: Path, tiny_model_dir: Path,
                                                                ray_gpu_node: Any) -> None:
    """4 ranks on the 4 GPUs leave none to the workers: Ray could put two ranks on one GPU, so `up` refuses."""
    done = subprocess.run([sys.executable, "-m", "earl_stream", "up", "--launcher", "ray", "--ray-address",
                           ray_gpu_node.address, "--steps", "1", f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}",
                           "trainer.nproc=4", "rollout.workers=2"], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "launcher.gpus=split on Ray" in done.stderr and "launcher.ray.rollout.num_gpus" in done.stderr, done.stderr[-2000:]
