"""Which CUDA devices each process of a run sees (`launcher.gpus`): one split for the local and the Ray launcher.

`split` (default): the trainer ranks see the first trainer.nproc visible GPUs (each rank takes its LOCAL_RANK's,
earl_stream/devices.py) and each rollout worker sees one of the others, round-robin; where no GPU is left over
(one GPU for everything, or as many as trainer ranks), the workers take the visible GPUs round-robin and share
them with the ranks. `shared`: every process sees every visible GPU, as `up` was started. A pool configured
on the CPU is not placed, and a host without CUDA devices changes nothing.

Visible GPUs are `CUDA_VISIBLE_DEVICES` where it is set (indices or UUIDs, as given), else torch's device count.

The local launcher hands each process its devices (`placement_for`). The Ray launcher cannot name devices: Ray
assigns them and sets each actor's CUDA_VISIBLE_DEVICES itself. It asks for amounts instead (`ray_gpu_shares`),
read off the same split over the cluster's GPUs: a process that has a GPU to itself reserves 1, one of k that
the split puts on one GPU reserves 1/k, so Ray gives each process its own GPU, or one GPU to k of them, as the
local split does. `shared` reserves none: Ray then leaves CUDA_VISIBLE_DEVICES alone and each process sees
every GPU of its node, as it does locally.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from earl_stream.config import RunConfig
from earl_stream.errors import ConfigError

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


@dataclasses.dataclass(frozen=True)
class GpuShares:
    """GPUs each process of a role reserves from Ray (Ray's num_gpus): 1 = a GPU of its own, 1/k = one of k
    processes on one GPU, 0 = none reserved (the process sees every GPU of its node)."""

    trainer: float
    rollout: float


def ray_gpu_shares(mode: str, gpus: int, *, trainer_ranks: int, rollout_workers: int, trainer_on_gpu: bool,
                   rollout_on_gpu: bool) -> GpuShares:
    """The amounts that make Ray place processes as `place_gpus` splits `gpus` GPUs (see the module docstring).

    Each process's share is 1 over the number of processes the split puts on its GPU, the most crowded of its
    role's GPUs (rank r takes GPU r, as LOCAL_RANK picks it where the ranks see every GPU). Ray fits fractions
    onto the fullest GPU that holds them, so two trainer ranks with fractions could land on one GPU, which NCCL
    refuses: a split that shares the ranks' GPUs with rollout workers is a ConfigError for more than one rank, as
    are more ranks than GPUs.
    """
    split = place_gpus(mode, [str(i) for i in range(gpus)], trainer_ranks=trainer_ranks,
                       rollout_workers=rollout_workers, trainer_on_gpu=trainer_on_gpu, rollout_on_gpu=rollout_on_gpu)
    if mode == "shared" or not gpus:
        return GpuShares(0.0, 0.0)
    if trainer_on_gpu and trainer_ranks > gpus:
        raise ConfigError(f"trainer.nproc={trainer_ranks} ranks on GPUs need as many GPUs (NCCL refuses two ranks on "
                          f"one) and the Ray cluster has {gpus}; lower trainer.nproc or set trainer.device=cpu")
    ranks = list(range(trainer_ranks)) if trainer_on_gpu else []
    workers = [int(g) for g in split.rollout if g is not None]
    load = [0] * gpus
    for g in ranks + workers:
        load[g] += 1
    trainer = _share(max((load[g] for g in ranks), default=0))
    if trainer_ranks > 1 and 0 < trainer < 1:
        raise ConfigError(f"launcher.gpus=split on Ray: the cluster's {gpus} GPU{'s' if gpus != 1 else ''} leave none "
                          f"to the {rollout_workers} rollout worker(s) beside the {trainer_ranks} trainer ranks, and Ray "
                          "cannot keep ranks that share GPUs with workers on GPUs of their own (NCCL refuses two ranks "
                          "on one); add GPUs, lower trainer.nproc, set rollout.device=cpu, or set "
                          "launcher.ray.trainer.num_gpus and launcher.ray.rollout.num_gpus yourself")
    return GpuShares(trainer, _share(max((load[g] for g in workers), default=0)))


def _share(processes: int) -> float:
    """1/processes, rounded down to Ray's resolution (1e-4) so that `processes` of them fit on one GPU."""
    return math.floor(10_000 / processes) / 10_000 if processes else 0.0


def ray_shares_for(cfg: RunConfig, gpus: int) -> GpuShares:
    """`ray_gpu_shares` for a run's config on a Ray cluster with `gpus` GPUs in all."""
    return ray_gpu_shares(cfg.launcher.gpus, gpus, trainer_ranks=cfg.trainer.nproc,
                          rollout_workers=cfg.rollout.workers, trainer_on_gpu=cfg.trainer.device != "cpu",
                          rollout_on_gpu=cfg.rollout.device != "cpu")
