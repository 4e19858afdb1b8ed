"""A model whose LM head is tied to its embedding (Qwen2-0.5B, SmolLM2 and most small instruct models)
keeps one shared weight under tensor parallelism and FSDP2 and through live re-shards with AdamW
state: two steps that re-shard dp2 -> tp2 -> fsdp2 in between equal two steps on dp2 alone, and a
tp2 step equals the single-process step."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

REL_TOL = 1e-5


def _tied_model_dir(root: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, tie_word_embeddings=True, initializer_range=0.1)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(root / "tied")
    return root / "tied"


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from test_parallel_equivalence import CountingPuller, _claim
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from earl_stream.config import TrainerConfig
    from earl_stream.workers.mesh import Placement, RankPlan, TrainerMesh
    from earl_stream.workers.sharding import apply_plan, relayout, shard_model
    from earl_stream.workers.train_step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        cfg = TrainerConfig()  # algo defaults: grad_clip 1.0, no entropy bonus

        def load() -> Any:
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()

        metas, rows = _claim(load())

        def step(model: Any, opt: Any, placement: Placement) -> float:
            return train_step(model, opt, metas, placement.layout, CountingPuller(rows), cfg, placement=placement).loss

        def adam(m: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(m.parameters(), lr=1e-3)

        def full(m: Any) -> dict[str, torch.Tensor]:
            return get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))

        results: dict[str, Any] = {}
        plans = {name: mesh.placement(RankPlan(dp=dp, fsdp=fsdp, tp=tp))
                 for name, dp, fsdp, tp in (("dp2", 2, 1, 1), ("tp2", 1, 1, 2), ("fsdp2", 1, 2, 1))}
        for route in (["dp2", "dp2", "dp2"], ["dp2", "tp2", "fsdp2"]):
            model = shard_model(load(), plans[route[0]])
            opt = adam(model)
            for a, b in zip(route, route[1:]):
                apply_plan(model, plans[a])
                step(model, opt, plans[a])
                if b != a:
                    relaid = relayout(model, opt, plans[b], adam)
                    model, opt = relaid.model, relaid.optimizer
                    assert model.lm_head.weight is model.get_input_embeddings().weight, "the tie survives"
            apply_plan(model, plans[route[-1]])
            step(model, opt, plans[route[-1]])
            results["->".join(route)] = full(model)
        model = shard_model(load(), plans["tp2"])
        apply_plan(model, plans["tp2"])
        results["tp2_loss"] = step(model, torch.optim.SGD(model.parameters(), lr=1.0), plans["tp2"])
        if rank == 0:
            model = load()
            apply_plan(model, Placement.single())
            results["reference_loss"] = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), metas,
                                                   Placement.single().layout, CountingPuller(rows), cfg).loss
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_tied_embeddings_survive_tensor_parallel_fsdp_and_live_reshards(tmp_path: Path) -> None:
    model_dir = _tied_model_dir(tmp_path)
    from spawned_ranks import free_port  # the rendezvous port, outside the ephemeral range

    port = free_port()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # spawned ranks import this module by name
    out = str(tmp_path / "r")
    mp.start_processes(_worker, args=(2, port, str(model_dir), out), nprocs=2, join=True, start_method="spawn")
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    for r in (r0, r1):
        stay, moved = r["dp2->dp2->dp2"], r["dp2->tp2->fsdp2"]
        scale = max(float(v.abs().max()) for v in stay.values())
        assert max(float((stay[k] - moved[k]).abs().max()) for k in stay) <= REL_TOL * scale
        assert torch.equal(moved["lm_head.weight"], moved["model.embed_tokens.weight"])
        assert abs(r["tp2_loss"] - r0["reference_loss"]) <= REL_TOL * abs(r0["reference_loss"])
