"""Packing does not change the math: the real `train_step` with `trainer.packing` on and off, from the
same weights on the same claim, gives the same loss, gradient norm and updated weights (within 1e-5,
fp32) on a single process (with a reference model's KL in the reward and two updates, which run the
log-prob pre-pass) and on two gloo ranks under dp2, fsdp2, tp2 and sp2 (sp with alignment padding
and recomputation). Budgets are small, so packed micro-batches hold several rows. The harness (claim,
Puller) is `tests/test_parallel_equivalence.py`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

REL_TOL = 1e-5
# (name, dp, fsdp, tp, sp, recompute, micro-batch tokens per rank)
PLANS = [("dp2", 2, 1, 1, 1, False, 100), ("fsdp2", 1, 2, 1, 1, False, 100), ("tp2", 1, 1, 2, 1, False, 100),
         ("sp2_recompute", 1, 1, 1, 2, True, 45)]


def _step(model_dir: str, claim: Any, placement: Any, packing: bool, algo: Any, rank: int = 0,
          ref: bool = False) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(loss, grad norm, full weights after) of one SGD(lr=1) step of a fresh model under `placement`."""
    from test_parallel_equivalence import CountingPuller
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from earl_stream.config import TrainerConfig
    from earl_stream.model import load_model
    from earl_stream.workers.sharding import apply_plan, shard_model
    from earl_stream.workers.train_step import train_step

    model, _ = load_model(model_dir)
    model.train()
    ref_model = load_model(model_dir)[0] if ref else None
    shard_model(model, placement)
    apply_plan(model, placement, extra_models=[ref_model] if ref_model is not None else [])
    metas, rows = claim
    cfg = TrainerConfig(micro_batch_tokens=placement.plan.micro_batch_tokens, packing=packing)
    res = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), metas, placement.layout, CountingPuller(rows),
                     cfg, algo=algo, rank=rank, placement=placement, ref_model=ref_model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return res.loss, res.grad_norm, {k: v.detach().clone() for k, v in full.items()}


def _same(packed: tuple[float, float, dict[str, torch.Tensor]], padded: tuple[float, float, dict[str, torch.Tensor]],
          init: dict[str, torch.Tensor], what: str) -> None:
    assert packed[0] == pytest.approx(padded[0], rel=REL_TOL), what
    assert packed[1] == pytest.approx(padded[1], rel=REL_TOL), what
    scale = max(float((v - init[k]).abs().max()) for k, v in padded[2].items())
    worst = max(float((packed[2][k] - v).abs().max()) for k, v in padded[2].items())
    assert scale > 1e-4 and worst <= REL_TOL * scale, f"{what}: weights differ by {worst:.3g} (change {scale:.3g})"


def test_packed_step_equals_padded_step_on_one_process(tiny_model_dir: Path) -> None:
    from test_parallel_equivalence import _claim

    from earl_stream.config import AlgoConfig
    from earl_stream.model import load_model
    from earl_stream.workers.mesh import Placement

    torch.set_num_threads(1)
    base, _ = load_model(tiny_model_dir)
    init = {k: v.clone() for k, v in base.state_dict().items()}
    claim = _claim(base)
    algo = AlgoConfig(grad_clip=0.0, entropy_coef=0.01, mini_batches=2, kl_coef=0.1, kl_in="reward")
    placement = Placement.single(micro_batch_tokens=120)
    got = [_step(str(tiny_model_dir), claim, placement, packing, algo, ref=True) for packing in (True, False)]
    _same(got[0], got[1], init, "one process")


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from test_parallel_equivalence import _claim

    from earl_stream.config import AlgoConfig
    from earl_stream.model import load_model
    from earl_stream.workers.mesh import RankPlan, TrainerMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        base, _ = load_model(model_dir)
        claim = _claim(base)
        algo = AlgoConfig(grad_clip=0.0, entropy_coef=0.01)
        results = {}
        for name, dp, fsdp, tp, sp, recompute, tokens in PLANS:
            placement = mesh.placement(RankPlan(dp=dp, fsdp=fsdp, tp=tp, sp=sp, recompute=recompute,
                                                micro_batch_tokens=tokens))
            results[name] = [_step(model_dir, claim, placement, packing, algo, rank) for packing in (True, False)]
        results["init"] = base.state_dict()
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_packed_step_equals_padded_step_on_dp_fsdp_tp_and_sp(tiny_model_dir: Path, tmp_path: Path) -> None:
    from spawned_ranks import spawn_ranks

    for rank, results in enumerate(spawn_ranks(_worker, 2, str(tiny_model_dir), str(tmp_path / "packing"))):
        for name, *_ in PLANS:
            _same(*results[name], results["init"], f"{name} rank {rank}")
