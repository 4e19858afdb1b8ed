"""Which CUDA devices each process of a local run sees (`launcher.gpus`): the local launcher's placement.

`split` (default): the trainer ranks see the first trainer.nproc visible GPUs (each rank takes its LOCAL_RANK's,
earl_stream/devices.py) and each rollout worker sees one of the others, round-robin; where no GPU is left over
(one GPU for everything, or as many as trainer ranks), the workers take the visible GPUs round-robin and share
them with the ranks. `shared`: every process sees every visible GPU, as `up` was started. A pool configured
on the CPU is not placed, and a host without CUDA devices changes nothing.

Visible GPUs are `CUDA_VISIBLE_DEVICES` where it is set (indices or UUIDs, as given), else torch's device count.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from earl_stream.config import RunConfig

CUDA_ENV = "CUDA_VISIBLE_DEVICES"


@dataclasses.dataclass(frozen=True)
class GpuPlacement:
    """CUDA_VISIBLE_DEVICES per role; None = unchanged (the process sees what `up` sees)."""

    trainer: str | None
    rollout: tuple[str | None, ...]

    def rollout_env(self, index: int) -> dict[str, str]:
        visible = self.rollout[index] if index < len(self.rollout) else None
        return {} if visible is None else {CUDA_ENV: visible}

    def trainer_env(self) -> dict[str, str]:
        return {} if self.trainer is None else {CUDA_ENV: self.trainer}


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The CUDA devices processes started from here can use: CUDA_VISIBLE_DEVICES's entries where it is set
    (an empty value hides every device), else torch's count (0 without a CUDA build or driver)."""
    env = os.environ if environ is None else environ
    if CUDA_ENV in env:
        return [d.strip() for d in env[CUDA_ENV].split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def place_gpus(mode: str, gpus: list[str], *, trainer_ranks: int, rollout_workers: int, trainer_on_gpu: bool,
               rollout_on_gpu: bool) -> GpuPlacement:
    """The split (see the module docstring) of `gpus` between `trainer_ranks` ranks and `rollout_workers` workers."""
    none = GpuPlacement(None, (None,) * rollout_workers)
    if mode == "shared" or not gpus:
        return none
    ranks = trainer_ranks if trainer_on_gpu else 0
    trainer = ",".join(gpus[:ranks]) if 0 < ranks < len(gpus) else None  # all of them: nothing to hide
    if not rollout_on_gpu:
        return GpuPlacement(trainer, none.rollout)
    spare = gpus[ranks:] or gpus  # the GPUs no trainer rank takes, else every one (shared with the ranks)
    return GpuPlacement(trainer, tuple(spare[i % len(spare)] for i in range(rollout_workers)))


def placement_for(cfg: RunConfig, environ: Mapping[str, str] | None = None) -> GpuPlacement:
    """`place_gpus` for a run's config on this host."""
    return place_gpus(cfg.launcher.gpus, visible_gpus(environ), trainer_ranks=cfg.trainer.nproc,
                      rollout_workers=cfg.rollout.workers, trainer_on_gpu=cfg.trainer.device != "cpu",
                      rollout_on_gpu=cfg.rollout.device != "cpu")
