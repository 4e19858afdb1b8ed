"""One rank of tests/workers/test_pool_rebind.py: `python pool_rebind_rank.py RANK INIT PLAN OUT [one|head]`.

one: rank 0 fails after its forward while rank 1 goes on into the backward; head: both ranks fail inside the
forward of the LM head (FSDP's root group, which holds the tied embedding, is then left unsharded)."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.workers.mesh import RankPlan, TrainerMesh
from earl_stream.workers.oom_step import AllocationFailure, TrainerOutOfMemory
from earl_stream.workers.pool_abort import PoolGuard
from earl_stream.workers.sharding import rebind, shard_model

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
PLANS = {"fsdp2": (1, 2, 1, 1), "tp2": (1, 1, 2, 1)}
ONE_RANK = False
IN_HEAD = False
ABORT_S = 1.5
MESSAGE = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes. Error code 12"


def _whole(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """The full model and optimizer state (collective over the model's mesh)."""
    full = StateDictOptions(full_state_dict=True)
    state = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    for k, s in get_optimizer_state_dict(model, opt, options=full)["state"].items():
        state.update({f"{k}:{n}": v.clone() for n, v in s.items()})
    return state


def _step(model: Any, opt: Any, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach())


def _rank(rank: int, init: str, plan_name: str, out: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timeout)
    guard = PoolGuard(rank, 2, backend="gloo", abort_seconds=ABORT_S, timeout=timeout)
    plan = RankPlan(*PLANS[plan_name])
    torch.manual_seed(0)
    config = Qwen2Config(**{**CONFIG, "tie_word_embeddings": IN_HEAD})
    model: Any = shard_model(Qwen2ForCausalLM(config).train(), TrainerMesh(2, rank, torch.device("cpu")).placement(plan))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12).reshape(1, 12) * 7 % CONFIG["vocab_size"]
    _step(model, opt, ids)  # a completed step: the optimizer has state
    before = _whole(model, opt)

    def fails() -> None:
        if ONE_RANK:  # rank 0 fails after its forward; rank 1 goes on into the backward's collectives
            loss = model(input_ids=ids).logits.float().pow(2).mean()
            if rank == 1:
                loss.backward()
                opt.step()
        if IN_HEAD:  # as a [s, V] logits allocation fails: inside the root group's forward
            def fail(module: Any, args: Any) -> None:
                raise RuntimeError(MESSAGE)

            hook = model.lm_head.register_forward_pre_hook(fail)
            try:
                model(input_ids=ids)
            finally:
                hook.remove()
        raise RuntimeError(MESSAGE)  # else both ranks fail at the step's first op: nobody is in a collective

    started = time.monotonic()
    try:
        outcome = guard.run(fails, opt, torch.device("cpu"))
        assert isinstance(outcome, AllocationFailure)
        guard.reform()
    except TrainerOutOfMemory as exc:  # ONE_RANK: the known limit, see tests/workers/test_pool_rebind.py
        Path(out, f"rank{rank}.json").write_text(json.dumps({"raised": str(exc), "s": time.monotonic() - started}))
        return
    placement = TrainerMesh(2, rank, torch.device("cpu")).placement(plan)
    relaid = rebind(model, opt, placement, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    model, opt = relaid.model, relaid.optimizer
    # the old groups are aborted: these collectives over the parameters' meshes run on the re-formed group
    after = _whole(model, opt)
    same = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    _step(model, opt, ids)  # the next step trains on the new mesh ...
    torch.manual_seed(0)  # ... as a pool that never failed would: the same model, both steps on the new group
    twin: Any = shard_model(Qwen2ForCausalLM(config).train(), placement)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    _step(twin, twin_opt, ids)
    _step(twin, twin_opt, ids)
    mine, theirs = _whole(model, opt), _whole(twin, twin_opt)
    next_same = sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"same": same, "next_same": next_same, "keys": len(before)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    ONE_RANK = len(sys.argv) > 5 and sys.argv[5] == "one"
    IN_HEAD = len(sys.argv) > 5 and sys.argv[5] == "head"
    _rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
