"""launcher.gpus: which CUDA devices each process of a local run sees (cli/launchers/gpus.py), and the Ray GPUs
each process of a Ray run reserves for the same split. No GPU is needed: the split is made from
CUDA_VISIBLE_DEVICES as `up` got it, and checked on the environment the local launcher gives each process; the
Ray amounts are checked here as arithmetic and on a Ray node with declared GPUs in tests/cli/test_ray_gpus.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from earl_stream.cli.launchers import RunSpec
from earl_stream.cli.launchers.gpus import GpuShares, place_gpus, placement_for, ray_gpu_shares, ray_shares_for, visible_gpus
from earl_stream.cli.launchers.local import LocalLauncher
from earl_stream.config import load_config, replace
from earl_stream.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EIGHT = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def test_the_8_gpu_preset_gives_the_ranks_0_to_3_and_each_rollout_worker_its_own() -> None:
    cfg = load_config(ROOT / "configs" / "gpu_node.yaml")
    placed = placement_for(cfg, EIGHT)
    assert placed.trainer == "0,1,2,3"
    assert placed.rollout == ("4", "5", "6", "7")


def test_split_round_robin_sharing_and_the_cpu() -> None:
    gpus = ["0", "1", "2"]
    # more workers than spare GPUs: round-robin over the spare ones
    assert place_gpus("split", gpus, trainer_ranks=1, rollout_workers=3, trainer_on_gpu=True,
                      rollout_on_gpu=True).rollout == ("1", "2", "1")
    # no GPU left over (one GPU for everything, or one per rank): the workers share every GPU, the ranks see all
    one = place_gpus("split", ["0"], trainer_ranks=1, rollout_workers=2, trainer_on_gpu=True, rollout_on_gpu=True)
    assert one.trainer is None and one.rollout == ("0", "0")
    even = place_gpus("split", gpus, trainer_ranks=3, rollout_workers=2, trainer_on_gpu=True, rollout_on_gpu=True)
    assert even.trainer is None and even.rollout == ("0", "1")
    # a trainer on the CPU leaves every GPU to the workers; workers on the CPU are not placed
    assert place_gpus("split", gpus, trainer_ranks=2, rollout_workers=2, trainer_on_gpu=False,
                      rollout_on_gpu=True).rollout == ("0", "1")
    cpu = place_gpus("split", gpus, trainer_ranks=2, rollout_workers=2, trainer_on_gpu=True, rollout_on_gpu=False)
    assert cpu.trainer == "0,1" and cpu.rollout == (None, None)
    # shared, or no GPU at all: nothing changes
    for placed in (place_gpus("shared", gpus, trainer_ranks=1, rollout_workers=2, trainer_on_gpu=True, rollout_on_gpu=True),
                   place_gpus("split", [], trainer_ranks=1, rollout_workers=2, trainer_on_gpu=True, rollout_on_gpu=True)):
        assert placed.trainer is None and placed.rollout == (None, None)
        assert placed.rollout_env(0) == {} and placed.trainer_env() == {}


def test_visible_gpus_follow_cuda_visible_devices_uuids_included() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}) == ["GPU-aa", "GPU-bb"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == [] and visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_the_local_launcher_hands_each_process_its_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    cfg = replace(load_config(None), "trainer.nproc=1", "rollout.workers=2", "trainer.device=auto",
                  "rollout.device=auto", f"run_dir={tmp_path / 'run'}")
    launcher = LocalLauncher(RunSpec(cfg, tmp_path / "run.yaml", tmp_path / "secret"))
    assert launcher.gpus.trainer_env() == {"CUDA_VISIBLE_DEVICES": "3"}
    assert [launcher.gpus.rollout_env(i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "5"},
                                                                {"CUDA_VISIBLE_DEVICES": "7"}]
    shared = LocalLauncher(RunSpec(replace(cfg, "launcher.gpus=shared"), tmp_path / "run.yaml", tmp_path / "secret"))
    assert shared.gpus.trainer_env() == {} and shared.gpus.rollout_env(0) == {}
    with pytest.raises(ConfigError):
        replace(cfg, "launcher.gpus=each")


def test_ray_reserves_the_split_as_amounts_of_gpus() -> None:
    on = {"trainer_on_gpu": True, "rollout_on_gpu": True}
    # a GPU each while the cluster has one for every rank and worker (the 8-GPU preset's 4 + 4)
    assert ray_shares_for(load_config(ROOT / "configs" / "gpu_node.yaml"), 8) == GpuShares(1.0, 1.0)
    assert ray_gpu_shares("split", 4, trainer_ranks=2, rollout_workers=2, **on) == GpuShares(1.0, 1.0)
    # fewer spare GPUs than workers: round-robin, i.e. the most crowded spare GPU holds 2 workers
    assert ray_gpu_shares("split", 4, trainer_ranks=2, rollout_workers=3, **on) == GpuShares(1.0, 0.5)
    assert ray_gpu_shares("split", 2, trainer_ranks=1, rollout_workers=3, **on) == GpuShares(1.0, 0.3333)
    # one GPU for everything: the rank and the workers share it, in shares that fit on one GPU
    one = ray_gpu_shares("split", 1, trainer_ranks=1, rollout_workers=2, **on)
    assert one == GpuShares(0.3333, 0.3333) and one.trainer + 2 * one.rollout <= 1.0
    # a pool on the CPU reserves none, and leaves every GPU to the other
    assert ray_gpu_shares("split", 3, trainer_ranks=2, rollout_workers=3, trainer_on_gpu=False,
                          rollout_on_gpu=True) == GpuShares(0.0, 1.0)
    assert ray_gpu_shares("split", 3, trainer_ranks=2, rollout_workers=3, trainer_on_gpu=True,
                          rollout_on_gpu=False) == GpuShares(1.0, 0.0)
    # shared, or a cluster without GPUs: none reserved (Ray then leaves CUDA_VISIBLE_DEVICES as the node has it)
    assert ray_gpu_shares("shared", 4, trainer_ranks=2, rollout_workers=2, **on) == GpuShares(0.0, 0.0)
    assert ray_gpu_shares("split", 0, trainer_ranks=2, rollout_workers=2, **on) == GpuShares(0.0, 0.0)


def test_ray_refuses_splits_that_would_put_two_ranks_on_one_gpu() -> None:
    on = {"trainer_on_gpu": True, "rollout_on_gpu": True}
    # Ray fits fractions onto the fullest GPU: two ranks sharing GPUs with workers could land on one GPU
    with pytest.raises(ConfigError, match="launcher.ray.rollout.num_gpus"):
        ray_gpu_shares("split", 2, trainer_ranks=2, rollout_workers=2, **on)
    with pytest.raises(ConfigError, match="trainer.nproc=3 ranks on GPUs need as many GPUs"):
        ray_gpu_shares("split", 2, trainer_ranks=3, rollout_workers=0, **on)
    # the same ranks with their workers on the CPU are fine: a GPU each
    assert ray_gpu_shares("split", 2, trainer_ranks=2, rollout_workers=2, trainer_on_gpu=True,
                          rollout_on_gpu=False) == GpuShares(1.0, 0.0)
