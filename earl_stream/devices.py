"""Which torch device a process computes on, from its config (`trainer.device`, `rollout.device`).

It owns the one rule every role uses: `auto` = this process's CUDA device when torch sees one, else
the CPU; `cuda` where none is visible is a ConfigError naming the key. Collective backends and
placement are the trainer mesh's business (`earl_stream.workers.mesh`).
"""

from __future__ import annotations

import torch

from earl_stream.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, *, key: str = "trainer.device", local_rank: int = 0) -> torch.device:
    """The device `key=name` means here: auto = CUDA device `local_rank % count` when there is one, else cpu.

    Selecting a CUDA device also makes it the process's current one (NCCL and kernels launch there).
    """
    if name not in DEVICE_CHOICES:
        raise ConfigError(f"{key}: {name!r} is not allowed; choose one of {', '.join(DEVICE_CHOICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda but torch sees no CUDA device; use {key}=cpu or auto")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
