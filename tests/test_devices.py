"""`trainer.device` / `rollout.device` resolution on a machine without CUDA (the CPU suite's side)."""

from __future__ import annotations

import pytest
import torch

from earl_stream.config import load_config
from earl_stream.devices import resolve_device
from earl_stream.errors import ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_auto_is_cpu_and_cuda_is_refused_by_name() -> None:
    assert resolve_device("auto", key="rollout.device") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"rollout\.device=cuda but torch sees no CUDA device; use rollout\.device=cpu"):
        resolve_device("cuda", key="rollout.device")


def test_config_knows_rollout_device() -> None:
    assert load_config().rollout.device == "auto"
    assert load_config(None, ["rollout.device=cpu"]).rollout.device == "cpu"
    with pytest.raises(ConfigError, match=r"rollout\.device: 'gpu' is not allowed; choose one of auto, cpu, cuda"):
        load_config(None, ["rollout.device=gpu"])


def test_a_pool_with_more_ranks_on_a_host_than_gpus_is_refused_before_it_picks_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trainer ranks on a one-GPU host would both take cuda:0, where NCCL refuses them with an opaque
    'invalid usage' (seen on an H100): the resolution names the key, the counts and the ways out instead."""
    picked: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    for name in ("auto", "cuda"):
        with pytest.raises(ConfigError, match=rf"trainer\.device={name}: 2 ranks of this pool run on this host but torch "
                                              r"sees 1 CUDA device, .*at most 1 per host \(trainer\.nproc, --nproc\) or "
                                              r"set trainer\.device=cpu"):
            resolve_device(name, local_rank=1, local_ranks=2)
    assert picked == []
    assert resolve_device("auto", local_rank=0, local_ranks=1) == torch.device("cuda", 0) and picked == [torch.device("cuda", 0)]
    assert resolve_device("cpu", local_rank=1, local_ranks=2) == torch.device("cpu")  # ranks share the CPU freely
