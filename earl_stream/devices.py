"""Which torch device a process computes on, from its config (`trainer.device`, `rollout.device`).

It owns the one rule every role uses: `auto` = this process's CUDA device when torch sees one, else
the CPU; `cuda` where none is visible is a ConfigError naming the key, and so is a pool with more ranks
on this host than CUDA devices (NCCL refuses two ranks on one GPU, and they would only compete for it).
Collective backends and placement are the trainer mesh's business (`earl_stream.workers.mesh`).
"""

from __future__ import annotations

import torch

from earl_stream.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, *, key: str = "trainer.device", local_rank: int = 0, local_ranks: int = 1) -> torch.device:
    """The device `key=name` means here: auto = CUDA device `local_rank % count` when there is one, else cpu.

    `local_ranks` > 1 (a trainer pool's ranks on this host) needs as many CUDA devices; fewer is a ConfigError
    (roles whose processes may share a GPU, like rollout workers, pass 1). Selecting a CUDA device also makes
    it the process's current one (NCCL and kernels launch there).
    """
    if name not in DEVICE_CHOICES:
        raise ConfigError(f"{key}: {name!r} is not allowed; choose one of {', '.join(DEVICE_CHOICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda but torch sees no CUDA device; use {key}=cpu or auto")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_ranks > count:
        raise ConfigError(f"{key}={name}: {local_ranks} ranks of this pool run on this host but torch sees {count} CUDA "
                          f"device{'s' if count != 1 else ''}, and each rank needs its own (NCCL refuses two ranks on one "
                          f"GPU); start at most {count} per host (trainer.nproc, --nproc) or set {key}=cpu")
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    return device
