"""Running a test's rank function on `world` spawned processes (torch.multiprocessing, as torchrun would
start ranks), for the tests that compare a parallel step with the single-process one.

`worker(rank, world, port, model, out)` runs one rank and saves what it measured to `{out}.{rank}` with
`torch.save`; `spawn_ranks` returns those, rank by rank. The spawned ranks unpickle `worker` by its module's
name, so the repository root goes on `sys.path` first: a test file passes run alone or in the suite.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = str(Path(__file__).resolve().parents[1])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the ranks' rendezvous), picked below the kernel's ephemeral range
    (32768-60999 here): a port bound to 0 comes from that range, which every outgoing connection of the other
    tests (gloo pairs, HTTP clients) also draws from, so another process could take it before rank 0 listens."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the low range is crowded: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(worker: Callable[..., None], world: int, model: Any, out: str) -> list[dict[Any, Any]]:
    """Run `worker` on `world` ranks and return each rank's saved results (a dict), rank 0 first."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    for attempt in range(3):
        try:
            mp.start_processes(worker, args=(world, free_port(), model, out), nprocs=world, join=True,
                               start_method="spawn")
            break
        except mp.ProcessRaisedException as exc:  # the port was taken between the pick and rank 0's listen
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
    return [torch.load(f"{out}.{rank}") for rank in range(world)]
