"""Launching a pool of gloo trainer ranks for a benchmark, each a fresh process (shared by benchmarks).

`launch` starts `world` copies of a benchmark script with `--rank R --world W --port P` appended,
waits for all of them, and returns the JSON object each printed on its last stdout line (rank
order). Fresh processes, not torch.multiprocessing: every rank gets the environment the caller
chose (e.g. MALLOC_MMAP_THRESHOLD_ for RSS measurements) and its own peak RSS. `join`, `rank_plan`
and `laid_out_model` are the few lines every rank needs to join the pool and lay a model out.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(script: str, args: list[str], world: int, *, env: dict[str, str] | None = None,
           timeout_s: float = 900.0) -> list[dict[str, Any]]:
    """Run `world` ranks of `script args`; SystemExit with the failing rank's stderr if any fails."""
    port = free_port()
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, script, *args, "--rank", str(r), "--world", str(world),
                               "--port", str(port)], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    outs = []
    try:
        for rank, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise SystemExit(f"rank {rank} of {script} {args} failed (exit {p.returncode}):\n{stderr[-3000:]}")
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def join(rank: int, world: int, port: int) -> None:
    """This process joins the gloo pool (one thread: the ranks share the machine's cores)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def rank_plan(name: str) -> Any:
    """`RankPlan` from its name (`dp2`, `fsdp2`, `tp2`, `sp2`, `fsdp2_tp2`, ...)."""
    from earl_stream.workers.mesh import RankPlan

    axes = {"dp": 1, "fsdp": 1, "tp": 1, "sp": 1}
    for part in name.split("_"):
        axis = part.rstrip("0123456789")
        axes[axis] = int(part[len(axis):])
    return RankPlan(**axes, micro_batch_tokens=1 << 20)


def laid_out_model(config: dict[str, Any], attn: str, plan_name: str, rank: int, world: int) -> tuple[Any, Any]:
    """A Qwen2 causal LM (the same seeded init on every rank) laid out under the named plan by
    `workers.sharding.shard_model`, with the plan's per-step knobs applied. Returns (model, placement)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from earl_stream.workers.mesh import TrainerMesh
    from earl_stream.workers.sharding import apply_plan, shard_model

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config, attn_implementation=attn, use_cache=False))
    model.train()
    placement = TrainerMesh(world, rank, torch.device("cpu")).placement(rank_plan(plan_name))
    shard_model(model, placement)
    apply_plan(model, placement)
    return model, placement
