"""launcher.gpus: which CUDA devices each process of a local run sees (cli/launchers/gpus.py). No GPU is needed:
the split is made from CUDA_VISIBLE_DEVICES as `up` got it, and checked on the environment the local launcher
gives each process."""

from __future__ import annotations

from pathlib import Path

import pytest

from earl_stream.cli.launchers import RunSpec
from earl_stream.cli.launchers.gpus import place_gpus, placement_for, visible_gpus
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
