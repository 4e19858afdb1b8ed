"""Expert parallelism does not change the math: on a fixed batch, a tiny mixture-of-experts model's loss,
gradient norm and updated weights under ep plans (experts sharded over gloo ranks, tokens dispatched by
all-to-all) equal the single-process step within 1e-5; live re-shards ep2 <-> fsdp2 (AdamW state
included) equal staying on one plan; routing replay under ep equals routing replay in one process;
and the published weight blocks cover every expert exactly once.

The real `train_step` runs in each rank (as `test_parallel_equivalence`), on a claim of rows of uneven
length; SGD with lr=1 makes the weight change equal to minus the gradient. Bad input (an expert count
ep does not divide, ep on a dense model, ep with tp/sp) is refused by the plan's `problems`.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_parallel_equivalence import LENGTHS, REL_TOL, CountingPuller, _check_pieces, _check_switches, _claim, _free_port

# (name, dp, fsdp, ep, recompute, micro-batch tokens per rank, routing replay)
PLANS = {2: [("ep2", 1, 1, 2, False, 4096, False), ("ep2_recompute_mb40", 1, 1, 2, True, 40, False),
             ("ep2_replay", 1, 1, 2, False, 4096, True), ("fsdp2", 1, 2, 1, False, 4096, False)],
         4: [("fsdp2_ep2", 1, 2, 2, False, 4096, False), ("dp2_ep2_mb64", 2, 1, 2, False, 64, True)]}
SWITCHES = {2: [("ep2", "fsdp2"), ("fsdp2", "ep2")], 4: [("fsdp2_ep2", "dp2_ep2_mb64")]}


def _routed(metas: list[Any], rows: dict[str, np.ndarray], layers: int, experts: int, top_k: int) -> list[Any]:
    """Recorded routing that is not the router's own (a random distinct top-k per token and layer): replay
    then changes the math, so that equal results mean the ranks replayed the same choices."""
    import msgspec

    from earl_stream.records import ROUTED_EXPERTS
    from earl_stream.store.schema import sample_key

    gen = torch.Generator().manual_seed(7)
    out = []
    for m in metas:
        n = m.total_tokens
        choice = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(n * layers)])
        arr = choice.reshape(n, layers, top_k).numpy().astype(np.uint8)
        rows[sample_key(m.sample_id, ROUTED_EXPERTS)] = arr.reshape(-1)  # the store's [T x L x k] row
        info = {ROUTED_EXPERTS: {"layers": layers, "top_k": top_k, "dtype": "|u1", "crc32": zlib.crc32(arr.tobytes())}}
        out.append(msgspec.structs.replace(m, info_json=json.dumps(info)))
    return out


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from earl_stream.config import AlgoConfig, TrainerConfig
    from earl_stream.model import load_model
    from earl_stream.workers.expert_parallel import expert_blocks
    from earl_stream.workers.mesh import Placement, RankPlan, TrainerMesh
    from earl_stream.workers.sharding import apply_plan, relayout, shard_model, shard_pieces
    from earl_stream.workers.train_step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        base, _ = load_model(model_dir)
        base.train()
        init = {k: v.clone() for k, v in base.state_dict().items()}
        metas, rows = _claim(base)
        c = base.config
        rows_replay = dict(rows)
        replayed = _routed(metas, rows_replay, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok)
        results: dict[Any, Any] = {}
        plans = {p[0]: (RankPlan(dp=p[1], fsdp=p[2], ep=p[3], recompute=p[4], micro_batch_tokens=p[5]), p[6])
                 for p in PLANS[world]}

        def fresh(plan: RankPlan) -> tuple[Any, Any]:
            assert not plan.problems(world, c), plan.problems(world, c)
            model, _ = load_model(model_dir)
            model.train()
            placement = mesh.placement(plan)
            shard_model(model, placement)
            apply_plan(model, placement)
            if plan.ep > 1:  # each rank holds its E/ep experts of every layer, nothing more
                local = [b.gate_up_proj.to_local().shape[0] for b in expert_blocks(model)]
                assert local == [c.num_experts // plan.ep] * c.num_hidden_layers, local
            return model, placement

        def step(model: Any, opt: Any, placement: Any, replay: bool, mbt: int = 0) -> Any:
            algo = AlgoConfig(grad_clip=0.0, entropy_coef=0.01, routing_replay="rollout" if replay else "none")
            cfg = TrainerConfig(micro_batch_tokens=mbt or placement.plan.micro_batch_tokens)
            return train_step(model, opt, replayed if replay else metas, placement.layout,
                              CountingPuller(rows_replay if replay else rows), cfg, algo=algo, rank=rank,
                              placement=placement)

        def full(model: Any) -> dict[str, torch.Tensor]:
            return {k: v.detach().clone() for k, v in
                    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}

        for name, (plan, replay) in plans.items():
            model, placement = fresh(plan)
            results["pieces", name] = [(p.name, p.offset, p.tensor.clone())
                                       for p in shard_pieces(model.state_dict(), placement)]
            res = step(model, torch.optim.SGD(model.parameters(), lr=1.0), placement, replay)
            results[name] = (res.loss, res.grad_norm, res.routing_mismatch,
                             {k: v - init[k] for k, v in full(model).items()})
        if rank == 0:  # the references: one process, the whole batch in one micro-batch
            for replay in (False, True):
                model, _ = load_model(model_dir)
                model.train()
                res = step(model, torch.optim.SGD(model.parameters(), lr=1.0), Placement.single(), replay, 1 << 20)
                results["reference", replay] = (res.loss, res.grad_norm, res.routing_mismatch,
                                                {k: v - init[k] for k, v in model.state_dict().items()})

        def adam(m: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(m.parameters(), lr=1e-3)

        for a, b in SWITCHES[world]:
            finals = []
            for second in (a, b):
                model, placement = fresh(plans[a][0])
                opt = adam(model)
                step(model, opt, placement, False)
                if second != a:  # a live re-shard between the two steps
                    placement = mesh.placement(plans[second][0])
                    relaid = relayout(model, opt, placement, adam)
                    model, opt = relaid.model, relaid.optimizer
                    apply_plan(model, placement)
                step(model, opt, placement, False)
                finals.append(full(model))
            results["switch", a, b] = finals
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _run(world: int, model_dir: Path, tmp_path: Path) -> list[dict[Any, Any]]:
    out = str(tmp_path / f"results{world}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    mp.start_processes(_worker, args=(world, _free_port(), str(model_dir), out), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(f"{out}.{r}") for r in range(world)]


def _check(results: list[dict[Any, Any]], world: int) -> None:
    for name, *_, replay in PLANS[world]:
        ref_loss, ref_norm, ref_mismatch, ref_delta = results[0]["reference", replay]
        scale = max(float(d.abs().max()) for d in ref_delta.values())
        assert scale > 1e-4, "the reference step must move the weights for the comparison to mean anything"
        for rank, r in enumerate(results):
            loss, norm, mismatch, delta = r[name]
            assert loss == pytest.approx(ref_loss, rel=REL_TOL), (name, rank)
            assert norm == pytest.approx(ref_norm, rel=REL_TOL), (name, rank)
            worst = max(float((delta[k] - ref_delta[k]).abs().max()) for k in ref_delta)
            assert worst <= REL_TOL * scale, f"{name} rank {rank}: max weight-change diff {worst:.3g} vs {scale:.3g}"
            if replay:  # the recorded routing is not the router's own: each rank counts its disagreements
                assert mismatch > 0.2, (name, rank, mismatch)
        _check_pieces(results, name, ref_delta)
    plain, replayed = results[0]["reference", False], results[0]["reference", True]
    assert abs(plain[0] - replayed[0]) > 1e-3, "replayed routing must change the loss for the check to mean anything"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from earl_stream.model.tiny_moe import init_moe_model

    return init_moe_model(tmp_path_factory.mktemp("moe_ep") / "m", experts=4, top_k=2, hidden_size=32,
                          expert_size=48, num_layers=2)


def test_ep2_matches_the_single_process_step_and_switches_keep_the_math(moe_dir: Path, tmp_path: Path) -> None:
    assert len(LENGTHS) == 8
    results = _run(2, moe_dir, tmp_path)
    _check(results, 2)
    _check_switches([{k: v for k, v in r.items() if isinstance(k, tuple) and k[0] == "switch"} for r in results])


@pytest.mark.slow
def test_fsdp2_ep2_and_dp2_ep2_on_four_ranks(moe_dir: Path, tmp_path: Path) -> None:
    results = _run(4, moe_dir, tmp_path)
    _check(results, 4)
    _check_switches([{k: v for k, v in r.items() if isinstance(k, tuple) and k[0] == "switch"} for r in results])


def test_bad_ep_degrees_are_refused_with_the_reason(moe_dir: Path, tiny_model_dir: Path) -> None:
    from earl_stream.model import load_model
    from earl_stream.workers.mesh import RankPlan

    moe = load_model(moe_dir)[0].config
    dense = load_model(tiny_model_dir)[0].config
    assert RankPlan(ep=2).problems(2, moe) == []
    assert any("ep=8 does not divide the 4 experts" in p for p in RankPlan(ep=8).problems(8, moe))
    assert any("dense model" in p for p in RankPlan(ep=2).problems(2, dense))
    assert any("expert parallel runs with dp / fsdp only" in p for p in RankPlan(ep=2, sp=2).problems(4, moe))


@pytest.mark.live
@pytest.mark.slow
def test_up_trains_a_tiny_moe_under_ep2(moe_dir: Path, tmp_path: Path) -> None:
    """`up` with `selector.plans=ep2` on two trainer ranks: the pool re-lays the model to ep2, trains with
    routing replay, publishes the experts from their shards and the rollout workers load the final version (they
    play its evaluation round)."""
    import subprocess

    run, summary = tmp_path / "run", tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary),
           f"model.path={moe_dir}", f"run_dir={run}", "trainer.groups_per_step=2", "trainer.group_size=4",
           "trainer.nproc=2", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2",
           "algo.routing_replay=rollout", "selector.plans=ep2", "eval.every=2", "eval.problems=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(summary.read_text())["steps"] == 2
    logs = "".join(p.read_text(errors="replace") for p in run.rglob("*.log"))
    assert logs.count("adopted trainer plan v1: ep2") == 2, "both ranks run ep2"
    # weights assembled from the expert shards reached rollout: the final version's evaluation round (which the
    # trainer waits for) is played with them
    assert "loaded policy version 2" in logs
