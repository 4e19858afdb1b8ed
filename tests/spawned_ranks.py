"""Running a test's rank function on `world` spawned processes (torch.multiprocessing, as torchrun would
start ranks), for the tests that compare a parallel step with the single-process one.

`worker(rank, world, port, model, out)` runs one rank and saves what it measured to `{out}.{rank}` with
`torch.save`; `spawn_ranks` returns those, rank by rank. The spawned ranks unpickle `worker` by its module's
name, so the repository root goes on `sys.path` first: a test file passes run alone or in the suite.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = str(Path(__file__).resolve().parents[1])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable[..., None], world: int, model: Any, out: str) -> list[dict[Any, Any]]:
    """Run `worker` on `world` ranks and return each rank's saved results (a dict), rank 0 first."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    mp.start_processes(worker, args=(world, free_port(), model, out), nprocs=world, join=True, start_method="spawn")
    return [torch.load(f"{out}.{rank}") for rank in range(world)]
