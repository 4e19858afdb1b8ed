"""The launcher contract, run by every launcher that can run here (local; ray on a real three-node Ray
cluster, `make test-ray`; slurm inside an allocation of a real Slurm cluster, `make test-slurm`): it
places a supervisor that answers with the run's secret, a rollout worker and a two-rank trainer pool
that register with it, brings back a rollout worker whose process was killed (by revive, or by
restarting it itself), and stop() leaves nothing running. The registry refuses duplicates, lists the
known names, and loads module:Name."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from cluster import wait_for
from ray_cluster import PLACEMENT

from earl_stream import protocol as P
from earl_stream.cli.launchers import (
    Launcher,
    Placed,
    RunSpec,
    known_launchers,
    make_launcher,
    register_launcher,
    resolve_launcher,
    unregister_launcher,
)
from earl_stream.cli.launchers.local import LocalLauncher
from earl_stream.cli.launchers.slurm import split_nodes
from earl_stream.cli.up import prepare
from earl_stream.config import load_config
from earl_stream.errors import ConfigError, SlurmError
from earl_stream.security.secret import create_secret_file, load_secret

pytestmark = pytest.mark.slow


def run_spec(tmp_path: Path, model_dir: Path, kind: str, *overrides: str) -> RunSpec:
    cfg = load_config(None, [f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}", f"launcher.kind={kind}",
                             "supervisor.heartbeat_s=0.2", "supervisor.lease_s=3", "trainer.nproc=2", *overrides])
    cfg, config_file = prepare(cfg)
    return RunSpec(cfg, config_file, create_secret_file(tmp_path / "secret"))


def _workers(client: P.ControlClient) -> list[dict[str, Any]]:
    return [w for w in json.loads(client.call(P.StatusRequest()).status_json)["workers"] if w["alive"]]


@pytest.mark.parametrize("kind", ["local", pytest.param("ray", marks=pytest.mark.ray),
                                  pytest.param("slurm", marks=pytest.mark.slurm)])
def test_launcher_contract(kind: str, tmp_path: Path, tiny_model_dir: Path, request: pytest.FixtureRequest) -> None:
    overrides: list[str] = []
    if kind == "ray":
        request.getfixturevalue("ray_cluster")
        overrides = PLACEMENT
    if kind == "slurm" and not os.environ.get("SLURM_JOB_ID"):
        pytest.skip("not inside a Slurm allocation (make test-slurm runs this under salloc)")
    spec = run_spec(tmp_path, tiny_model_dir, kind, *overrides)
    launcher = make_launcher(spec)
    assert isinstance(launcher, Launcher)
    placed: list[Placed] = []
    try:
        sup, address = launcher.start_supervisor()
        placed.append(sup)
        assert isinstance(sup, Placed) and address.startswith("tcp://") and sup.poll() is None
        client = P.ControlClient(address, timeout_s=10, secret=load_secret(str(spec.secret_file)),
                                 encrypt=spec.cfg.security.encrypt)  # on by default for ray and slurm
        worker = launcher.start_rollout_worker(0, address)
        pool = launcher.start_trainer_pool(address)
        placed += [worker, pool]
        ranks = wait_for(lambda: sorted(w["rank"] for w in _workers(client) if w["role"] == "trainer") == [0, 1],
                         120, "both trainer ranks to register")
        assert ranks
        first = wait_for(lambda: [w for w in _workers(client) if w["role"] == "rollout"], 60, "the rollout worker")
        assert first[0]["host"] and (first[0]["ray_node_id"] != "") == (kind == "ray")
        os.kill(first[0]["pid"], signal.SIGKILL)
        if kind != "ray":  # Ray restarts its actor itself; the others are revived
            wait_for(lambda: worker.poll() is not None, 10, "the killed worker's exit")
            assert "rollout worker 0" in worker.describe_exit()
            launcher.revive(worker, address)
        again = wait_for(lambda: [w for w in _workers(client) if w["role"] == "rollout" and w["pid"] != first[0]["pid"]],
                         90, "the rollout worker to come back and register again")
        assert again[0]["id"] != first[0]["id"]
    finally:
        launcher.stop()
        launcher.stop()  # twice is safe
    assert all(p.poll() is not None for p in placed)


def test_the_builtin_launchers_are_registered() -> None:
    assert {"local", "ray", "slurm"} <= set(known_launchers())
    assert resolve_launcher("local") is LocalLauncher


def test_slurm_outside_an_allocation_says_what_to_do(tmp_path: Path, tiny_model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SlurmError, match=r"inside a Slurm allocation.*salloc -N 3 earl-stream up --launcher slurm"):
        make_launcher(run_spec(tmp_path, tiny_model_dir, "slurm"))
    with pytest.raises(ConfigError, match="trainer.nproc=2 does not split over launcher.slurm.trainer_nodes=3"):
        make_launcher(run_spec(tmp_path, tiny_model_dir, "slurm", "launcher.slurm.trainer_nodes=3"))


def test_slurm_splits_the_allocation_between_the_pools() -> None:
    assert split_nodes(["n0", "n1", "n2"], 1) == (["n0", "n1"], ["n2"])
    assert split_nodes(["n0", "n1", "n2"], 2) == (["n0"], ["n1", "n2"])
    assert split_nodes(["n0"], 1) == (["n0"], ["n0"])  # one node: everything shares it
    with pytest.raises(SlurmError, match="trainer_nodes=3 but the allocation has 2 node"):
        split_nodes(["n0", "n1"], 3)


def test_registry_refuses_duplicates_and_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_launcher("local", LocalLauncher)
    register_launcher("mine", LocalLauncher)
    try:
        assert resolve_launcher("mine") is LocalLauncher and "mine" in known_launchers()
        with pytest.raises(ConfigError, match="already registered"):
            register_launcher("mine", LocalLauncher)
    finally:
        unregister_launcher("mine")
    with pytest.raises(ConfigError, match="known launchers: local, ray, slurm"):
        resolve_launcher("kubernetes")
    assert resolve_launcher("earl_stream.cli.launchers.local:LocalLauncher") is LocalLauncher
    with pytest.raises(ConfigError, match="failed to load"):
        resolve_launcher("earl_stream.cli.launchers.local:Nope")
