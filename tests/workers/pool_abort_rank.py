"""One rank of tests/workers/test_pool_abort.py's pool: `python pool_abort_rank.py RANK INIT SCENARIO OUT ABORT_S FAIL_AFTER_S`."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from earl_stream.workers.oom_step import AllocationFailure, TrainerOutOfMemory
from earl_stream.workers.pool_abort import PoolGuard

CPU = torch.device("cpu")
MESSAGE = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes. Error code 12"
ABORT_S = float(sys.argv[5]) if len(sys.argv) > 6 else 3.0  # trainer.oom_abort_seconds
FAIL_AFTER_S = float(sys.argv[6]) if len(sys.argv) > 6 else 0.5  # the failing rank computes this long before it fails


def _busy(seconds: float) -> None:
    """Compute (many small ops, as a forward pass does) for `seconds`."""
    end = time.monotonic() + seconds
    x = torch.ones(64, 64)
    while time.monotonic() < end:
        x = (x @ x).clamp(-1, 1)


def _rank(rank: int, init: str, scenario: str, out: str) -> None:
    timeout = datetime.timedelta(seconds=60)  # the default timeouts are never what ends the step
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timeout)
    guard = PoolGuard(rank, 2, backend="gloo", abort_seconds=ABORT_S, timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    dist.barrier()  # a pool has met before its step (the claim's collectives): its connections are up

    def step() -> str:
        model(torch.ones(2, 8)).sum().backward()
        if rank == 0 and scenario != "after_step":
            _busy(FAIL_AFTER_S)
            raise RuntimeError(MESSAGE)
        if rank == 1 and scenario == "busy":
            _busy(30.0)  # computing, far longer than the bound: only the watcher can end it
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)  # rank 1 (blocked): waits here for rank 0
        opt.step()
        if rank == 0:  # after_step: the update is applied, then the step's temporaries fail to allocate
            raise RuntimeError(MESSAGE)
        dist.barrier()
        return "done"

    started = time.monotonic()
    result: dict[str, object] = {"rank": rank}
    try:
        outcome = guard.run(step, opt, CPU)
        result["left_s"] = time.monotonic() - started
        result["failure"] = isinstance(outcome, AllocationFailure)
        result["intact"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        result["grads"] = [p.grad is not None for p in model.parameters()]
        failure = guard.reform()
        result["failed_rank"] = failure.rank
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        result["reformed_sum"] = x.item()
        result["generation"] = guard.generation
    except TrainerOutOfMemory as exc:
        result["left_s"] = time.monotonic() - started
        result["raised"] = str(exc)
    except RuntimeError as exc:
        result["left_s"] = time.monotonic() - started
        result["raised"] = str(exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
