"""Every plan pair a two-rank pool switches between moves weights and AdamW state exactly (they are
copies), keeps a tied LM head tied and the rotary buffers right, and works for a reference model
without an optimizer. The math of steps around a switch: tests/test_parallel_equivalence.py and
tests/workers/test_tied_reshard.py; the memory of a switch: tests/workers/test_reshard_memory.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=512, tie_word_embeddings=True, use_cache=False)
# every pair of dp2, fsdp2 and tp2, both ways (sp2 holds the model as dp2 does; fsdp2_sp2 -> dp2_tp2 on four
# ranks: tests/test_parallel_equivalence.py)
ROUTE = ["dp2", "fsdp2", "tp2", "fsdp2", "dp2", "tp2", "dp2"]
PLANS = {"dp2": (2, 1, 1), "fsdp2": (1, 2, 1), "tp2": (1, 1, 2)}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from earl_stream.workers.mesh import RankPlan, TrainerMesh
    from earl_stream.workers.sharding import relayout, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        placements = {k: mesh.placement(RankPlan(*v)) for k, v in PLANS.items()}
        torch.manual_seed(0)
        model: Any = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).train()
        ref: Any = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).eval().requires_grad_(False)
        ids = torch.arange(12).reshape(1, 12) * 7 % CONFIG["vocab_size"]
        logits = ref(input_ids=ids).logits
        shard_model(model, placements[ROUTE[0]])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        for p in model.parameters():  # dp2: replicas see the same gradients
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        full = StateDictOptions(full_state_dict=True)

        def whole(m: Any, o: Any) -> dict[str, torch.Tensor]:
            state = {k: v.clone() for k, v in get_model_state_dict(m, options=full).items()}
            if o is not None:
                for k, s in get_optimizer_state_dict(m, o, options=full)["state"].items():
                    state.update({f"{k}:{n}": v.clone() for n, v in s.items()})
            return state

        first, first_ref = whole(model, opt), whole(ref, None)
        problems = []

        def adam(m: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(m.parameters(), lr=1e-3)  # betas from the moved groups

        for a, b in zip(ROUTE, ROUTE[1:]):
            relaid = relayout(model, opt, placements[b], adam, bucket_bytes=8 << 10)
            model, opt = relaid.model, relaid.optimizer
            ref = relayout(ref, None, placements[b], adam).model
            now, now_ref = whole(model, opt), whole(ref, None)
            if sorted(now) != sorted(first) or any(not torch.equal(now[k], v) for k, v in first.items()):
                problems.append(f"{a}->{b}: weights or AdamW state changed")
            if any(not torch.equal(now_ref[k], v) for k, v in first_ref.items()):
                problems.append(f"{a}->{b}: the reference model changed")
            if model.lm_head.weight is not model.get_input_embeddings().weight:
                problems.append(f"{a}->{b}: the LM head came untied")
            if opt.param_groups[0]["betas"] != (0.8, 0.9):
                problems.append(f"{a}->{b}: hyper-parameters of the groups were lost")
            if any(p.requires_grad for p in ref.parameters()) or ref.training or not model.training:
                problems.append(f"{a}->{b}: requires_grad or train/eval mode changed")
            inv = ref.model.rotary_emb.inv_freq
            if not torch.equal(inv, Qwen2ForCausalLM(Qwen2Config(**CONFIG)).model.rotary_emb.inv_freq):
                problems.append(f"{a}->{b}: rotary inv_freq not restored")
        if not torch.equal(ref(input_ids=ids).logits, logits):  # back on dp2: the same outputs
            problems.append("the reference model's logits changed")
        torch.save(problems, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_every_plan_pair_moves_weights_and_adam_state_exactly(tmp_path: Path) -> None:
    from spawned_ranks import free_port  # the rendezvous port, outside the ephemeral range

    port = free_port()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    out = str(tmp_path / "r")
    mp.start_processes(_worker, args=(2, port, out), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        assert torch.load(f"{out}.{rank}") == [], rank
