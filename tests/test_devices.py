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
