"""Every dense family trains under every plan with the math of one process.

For each family of `model.tiny_families` (Llama 3, Qwen2, Qwen3, Mistral, Gemma 3 text, Phi-3,
SmolLM3, OLMo 2, Granite), two gloo ranks run the real `train_step` on the same claim under dp2,
fsdp2, tp2 and sp2 (packed micro-batches, the trainer's default, with budgets small enough that
several rows share one sequence; sp2 padded too), and one process runs it packed; under `live`
four ranks run fsdp2 x tp2 and tp2 x sp2 for the default tier's families. Each equals the reference, one
process with the whole batch padded in one micro-batch through the model's own attention (its own
causal and sliding-window masks), in loss, gradient norm and updated weights (SGD, lr=1, no
clipping: the weight change is minus the gradient) within 1e-5. A family whose config refuses a plan
(`workers.tensor_parallel.family_problems`) is checked for the refusal instead. The harness (claim,
Puller) is `tests/test_parallel_equivalence.py`'s.

qwen3 (per-head q/k norms), gemma3_text (sliding-window layers, scaled embedding) and phi3 (fused
projections) run in the default tier, the other families under `live`: one spawn runs a tier's
families together, so process start and imports are paid once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from earl_stream.model.tiny_families import FAMILIES

REL_TOL = 1e-5
DEFAULT = ("qwen3", "gemma3_text", "phi3")
LIVE = tuple(f for f in FAMILIES if f not in DEFAULT)
# (name, dp, fsdp, tp, sp, micro-batch tokens per rank, packing)
PLANS = {2: [("dp2", 2, 1, 1, 1, 100, True), ("fsdp2", 1, 2, 1, 1, 100, True), ("tp2", 1, 1, 2, 1, 100, True),
             ("sp2", 1, 1, 1, 2, 45, True), ("sp2_padded", 1, 1, 1, 2, 4096, False)],
         4: [("fsdp2_tp2", 1, 2, 2, 1, 100, True), ("tp2_sp2", 1, 1, 2, 2, 45, True)]}


def _step(model_dir: str, claim: Any, placement: Any, *, packing: bool, rank: int = 0
          ) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(loss, grad norm, full weights after) of one SGD(lr=1) step of a fresh model under `placement`."""
    from test_parallel_equivalence import CountingPuller
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from earl_stream.config import AlgoConfig, TrainerConfig
    from earl_stream.model import load_model
    from earl_stream.workers.sharding import apply_plan, shard_model
    from earl_stream.workers.train_step import train_step

    model, _ = load_model(model_dir)
    model.train()
    shard_model(model, placement)
    apply_plan(model, placement)
    metas, rows = claim
    cfg = TrainerConfig(micro_batch_tokens=placement.plan.micro_batch_tokens, packing=packing)
    res = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), metas, placement.layout, CountingPuller(rows),
                     cfg, algo=AlgoConfig(grad_clip=0.0, entropy_coef=0.01), rank=rank, placement=placement)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return res.loss, res.grad_norm, {k: v.detach().clone() for k, v in full.items()}


def _worker(rank: int, world: int, port: int, dirs: dict[str, str], out: str) -> None:
    import torch.distributed as dist
    from test_parallel_equivalence import _claim

    from earl_stream.model import load_model
    from earl_stream.workers.mesh import Placement, RankPlan, TrainerMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        results: dict[Any, Any] = {}
        for family, model_dir in dirs.items():
            base, _ = load_model(model_dir)
            claim = _claim(base)
            results[family, "init"] = {k: v.clone() for k, v in base.state_dict().items()}
            for name, dp, fsdp, tp, sp, budget, packing in PLANS[world]:
                plan = RankPlan(dp=dp, fsdp=fsdp, tp=tp, sp=sp, micro_batch_tokens=budget)
                problems = plan.problems(world, base.config)
                if problems:
                    results[family, name] = "; ".join(problems)
                    continue
                results[family, name] = _step(model_dir, claim, mesh.placement(plan), packing=packing, rank=rank)
            if rank == 0:  # the references: one process, the model's own attention (padded), and packed
                results[family, "reference"] = _step(model_dir, claim, Placement.single(micro_batch_tokens=1 << 20),
                                                     packing=False)
                results[family, "packed"] = _step(model_dir, claim, Placement.single(micro_batch_tokens=100),
                                                  packing=True)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


_RUNS: dict[tuple[tuple[str, ...], int], list[dict[Any, Any]]] = {}


def _results(families: tuple[str, ...], root: Path, world: int = 2) -> list[dict[Any, Any]]:
    """Every rank's results for `families`, run once per session in one spawn of `world` processes."""
    if (families, world) not in _RUNS:
        from spawned_ranks import spawn_ranks

        from earl_stream.model.tiny_families import init_family_model

        dirs = {f: str(init_family_model(root / f, family=f)) for f in families}
        _RUNS[families, world] = spawn_ranks(_worker, world, dirs, str(root / "results"))
    return _RUNS[families, world]


def _same(got: tuple[float, float, dict[str, torch.Tensor]], ref: tuple[float, float, dict[str, torch.Tensor]],
          init: dict[str, torch.Tensor], what: str) -> None:
    assert got[0] == pytest.approx(ref[0], rel=REL_TOL), f"{what}: loss {got[0]} vs {ref[0]}"
    assert got[1] == pytest.approx(ref[1], rel=REL_TOL), f"{what}: grad norm {got[1]} vs {ref[1]}"
    scale = max(float((v - init[k]).abs().max()) for k, v in ref[2].items())
    worst = max(float((got[2][k] - v).abs().max()) for k, v in ref[2].items())
    assert scale > 1e-4 and worst <= REL_TOL * scale, f"{what}: weights differ by {worst:.3g} (change {scale:.3g})"


def _check(family: str, results: list[dict[Any, Any]]) -> None:
    ref, init = results[0][family, "reference"], results[0][family, "init"]
    _same(results[0][family, "packed"], ref, init, f"{family} packed, one process")
    for name, *_ in PLANS[len(results)]:
        for rank, r in enumerate(results):
            got = r[family, name]
            assert not isinstance(got, str), f"{family} {name} refused: {got}"
            _same(got, ref, init, f"{family} {name} rank {rank}")


@pytest.mark.parametrize("family", DEFAULT)
def test_family_trains_the_same_under_every_two_rank_plan(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    _check(family, _results(DEFAULT, tmp_path_factory.mktemp("families")))


@pytest.mark.live
@pytest.mark.parametrize("family", LIVE)
def test_other_families_train_the_same_under_every_two_rank_plan(family: str,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    _check(family, _results(LIVE, tmp_path_factory.mktemp("families")))


@pytest.mark.live
@pytest.mark.parametrize("family", DEFAULT)
def test_family_trains_the_same_under_four_rank_plans(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    _check(family, _results(DEFAULT, tmp_path_factory.mktemp("families4"), world=4))
