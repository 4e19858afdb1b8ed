"""Dynamic sequence parallelism per micro-batch (`trainer.dynamic_sp_tokens`, `workers.dynamic_sp`).

The plan of an update: rows longer than the threshold become shared micro-batches (one row each, in
claim order, the same on every rank, ahead of each rank's own ones), each rank pulling its contiguous
slice of them and its own short rows whole. On two gloo ranks (fsdp2 and dp2, packed and padded,
with recomputation), a step that runs shared rows at sp 2 and the others at sp 1 equals the
single-process step on the same rows: loss, gradient norm and updated weights within 1e-5. Placements
that cannot run it are refused with a ConfigError before the step. The harness (claim, Puller) is
`tests/test_parallel_equivalence.py`'s.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from earl_stream.config import AlgoConfig, TrainerConfig
from earl_stream.errors import ConfigError
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.workers.dynamic_sp import DynamicSp
from earl_stream.workers.mesh import Placement, RankPlan

LENGTHS = [23, 64, 41, 57, 30, 48, 35, 52]  # test_parallel_equivalence's claim
THRESHOLD = 50  # rows 1, 3 and 7 (64, 57, 52 tokens) run shared
SHARED = [1, 3, 7]
REL_TOL = 1e-5
PER_TOKEN = 4 + 1 + 4  # int32 ids, uint8 mask, float32 log-probs
# (name, dp, fsdp, recompute, packing, micro-batch tokens per rank)
PLANS = [("fsdp2", 1, 2, False, True, 60), ("fsdp2_padded", 1, 2, False, False, 60),
         ("fsdp2_recompute", 1, 2, True, True, 45), ("dp2", 2, 1, False, True, 60)]


def _metas(lengths: list[int]) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"s{i}", prompt_ordinal=i // 4, episode_id=f"s{i}",
                       group_id=f"g{i // 4}", env="test", turns=1, prompt_tokens=6, response_tokens=n - 6,
                       total_tokens=n, reward=0.0, advantage=None, policy_version_min=0, policy_version_max=0,
                       producer_id="p", producer_address="local", checksum=0, created_at=0.0, info_json="{}")
            for i, n in enumerate(lengths)]


def _placement(plan: RankPlan, rank: int) -> Placement:
    return Placement(plan=plan, layout=plan.layout(rank))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("fsdp", [True, False])
def test_shared_micro_batches_come_first_in_the_same_order_on_every_rank(packed: bool, fsdp: bool) -> None:
    from earl_stream.workers.step_batches import plan_updates

    plan = RankPlan(dp=1 if fsdp else 2, fsdp=2 if fsdp else 1, micro_batch_tokens=60)
    metas = _metas(LENGTHS)
    minis = [plan_updates(metas, plan.layout(r), _placement(plan, r), 60, AlgoConfig(), packed=packed,
                   dynamic=DynamicSp(tokens=THRESHOLD, degree=2, rank=r))[0] for r in range(2)]
    own: list[set[int]] = []
    for r, mini in enumerate(minis):
        assert mini.shared == 3 and mini.shared_sp == (2, r)
        assert mini.micro_batches[:3] == [[i] for i in SHARED]  # every rank, the same order
        for k, i in enumerate(SHARED):
            n = -(-LENGTHS[i] // 2)  # one row: packed and padded windows agree
            assert mini.windows[k] == (r * n, n)
            assert mini.ranges is not None and mini.ranges[i] == [(r * n, min(r * n + n + 1, LENGTHS[i]))]
            assert mini.sp(k, plan.layout(r)) == (2, r)
        rest = {i for mb in mini.micro_batches[3:] for i in mb}
        assert all(LENGTHS[i] <= THRESHOLD for i in rest) and not rest & set(mini.ranges)  # own rows: whole
        assert sorted(mini.rows) == sorted(SHARED + sorted(rest))
        assert all(mini.sp(k, plan.layout(r)) == (1, 0) for k in range(3, mini.passes))
        own.append(rest)
    assert not own[0] & own[1] and own[0] | own[1] == {i for i, n in enumerate(LENGTHS) if n <= THRESHOLD}
    if fsdp:  # lockstep: FSDP gathers in every pass
        assert minis[0].passes == minis[1].passes == 3 + max(len(m.micro_batches) - 3 for m in minis)
    else:
        assert all(m.passes == len(m.micro_batches) for m in minis)


def test_each_update_shares_its_own_long_rows() -> None:
    from earl_stream.workers.step_batches import plan_updates

    plan = RankPlan(fsdp=2, micro_batch_tokens=60)
    minis = plan_updates(_metas(LENGTHS), plan.layout(1), _placement(plan, 1), 60, AlgoConfig(mini_batches=2),
                  dynamic=DynamicSp(tokens=THRESHOLD, degree=2, rank=1))
    assert [m.micro_batches[: m.shared] for m in minis] == [[[1], [3]], [[7]]]


def test_off_unless_tokens_are_set_on_several_data_ranks_at_sp_1() -> None:
    config = types.SimpleNamespace(num_attention_heads=4, model_type="qwen2")
    for tokens, plan in ((0, RankPlan(fsdp=2)), (50, RankPlan(sp=2)), (50, RankPlan())):
        assert not DynamicSp.of(tokens, _placement(plan, 0), config).on
    got = DynamicSp.of(50, _placement(RankPlan(dp=2, fsdp=2), 3), config)
    assert (got.tokens, got.degree, got.rank) == (50, 4, 3)
    assert DynamicSp(tokens=50, degree=2).shared(LENGTHS) == SHARED


def test_heads_that_the_data_ranks_do_not_divide_are_refused_before_the_step(tiny_model_dir: Path) -> None:
    from earl_stream.model import load_model
    from earl_stream.workers.train_step import train_step

    model, _ = load_model(tiny_model_dir)  # 4 heads
    plan = RankPlan(dp=3)

    class Untouched:
        def pull(self, *_: Any, **__: Any) -> Any:
            raise AssertionError("pulled before the plan was checked")

        pull_many = pull

    with pytest.raises(ConfigError, match=r"trainer\.dynamic_sp_tokens=50.*does not divide the model's 4 attention heads"):
        train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), _metas(LENGTHS), plan.layout(0), Untouched(),
                   TrainerConfig(dynamic_sp_tokens=50), placement=_placement(plan, 0))


def test_tensor_parallel_and_experts_are_refused() -> None:
    config = types.SimpleNamespace(num_attention_heads=4, model_type="qwen2")
    with pytest.raises(ConfigError, match=r"trainer\.dynamic_sp_tokens=50: plan .* is tensor parallel"):
        DynamicSp.of(50, _placement(RankPlan(dp=2, tp=2), 0), config)
    with pytest.raises(ConfigError, match=r"trainer\.dynamic_sp_tokens.*tensor parallel"):
        DynamicSp.of(50, _placement(RankPlan(tp=2), 0), config)
    moe = types.SimpleNamespace(num_attention_heads=4, model_type="qwen2_moe", num_experts=4)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        DynamicSp.of(50, _placement(RankPlan(fsdp=2), 0), moe)


def _step(model_dir: str, claim: Any, placement: Any, cfg: TrainerConfig, rank: int = 0
          ) -> tuple[float, float, dict[str, torch.Tensor], int, list[int]]:
    """(loss, grad norm, full weights after, bytes pulled, sp degree of every attention forward of the
    first layer) of one SGD(lr=1) step of a fresh model under `placement`."""
    from test_parallel_equivalence import CountingPuller
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from earl_stream.model import load_model
    from earl_stream.workers.sharding import apply_plan, shard_model
    from earl_stream.workers.train_step import train_step
    from earl_stream.workers.ulysses import sp_state

    model, _ = load_model(model_dir)
    model.train()
    degrees: list[int] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: degrees.append(sp_state()[0]))
    shard_model(model, placement)
    apply_plan(model, placement)
    metas, rows = claim
    puller = CountingPuller(rows)
    algo = AlgoConfig(grad_clip=0.0, entropy_coef=0.01)
    res = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), metas, placement.layout, puller, cfg,
                     algo=algo, rank=rank, placement=placement)
    assert sp_state() == (1, 0), "a shared micro-batch left Ulysses in force"
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return res.loss, res.grad_norm, {k: v.detach().clone() for k, v in full.items()}, puller.bytes, degrees


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from test_parallel_equivalence import _claim

    from earl_stream.model import load_model
    from earl_stream.workers.mesh import TrainerMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        base, _ = load_model(model_dir)
        claim = _claim(base)
        assert [m.total_tokens for m in claim[0]] == LENGTHS
        results: dict[Any, Any] = {"init": base.state_dict()}
        for name, dp, fsdp, recompute, packing, tokens in PLANS:
            placement = mesh.placement(RankPlan(dp=dp, fsdp=fsdp, recompute=recompute, micro_batch_tokens=tokens))
            cfg = TrainerConfig(micro_batch_tokens=tokens, packing=packing, dynamic_sp_tokens=THRESHOLD)
            results[name] = _step(model_dir, claim, placement, cfg, rank)
        if rank == 0:  # the reference: one process, every row in one micro-batch
            for packing in (True, False):
                cfg = TrainerConfig(micro_batch_tokens=1 << 20, packing=packing, dynamic_sp_tokens=THRESHOLD)
                results["reference", packing] = _step(model_dir, claim, Placement.single(), cfg)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_a_step_mixing_sp_2_and_sp_1_micro_batches_equals_the_single_process_step(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    from spawned_ranks import spawn_ranks

    results = spawn_ranks(_worker, 2, str(tiny_model_dir), str(tmp_path / "dynamic_sp"))
    init = results[0]["init"]
    short = sum(n for n in LENGTHS if n <= THRESHOLD)
    for name, _, _, recompute, packing, _ in PLANS:
        ref_loss, ref_norm, ref_weights, _, ref_degrees = results[0]["reference", packing]
        assert set(ref_degrees) == {1}
        scale = max(float((v - init[k]).abs().max()) for k, v in ref_weights.items())
        assert scale > 1e-4, "the reference step must move the weights"
        for rank in range(2):
            loss, norm, weights, _, degrees = results[rank][name]
            assert loss == pytest.approx(ref_loss, rel=REL_TOL), (name, rank)
            assert norm == pytest.approx(ref_norm, rel=REL_TOL), (name, rank)
            worst = max(float((weights[k] - v).abs().max()) for k, v in ref_weights.items())
            assert worst <= REL_TOL * scale, f"{name} rank {rank}: weights differ by {worst:.3g} (change {scale:.3g})"
            # the three shared rows ran at sp 2 (twice each with recomputation), the rank's own rows at sp 1
            assert degrees.count(2) == 3 * (2 if recompute else 1) and 1 in degrees, (name, rank, degrees)
        # each rank pulled its own short rows whole and its slice (plus the next token) of each shared row
        pulled = sum(results[rank][name][3] for rank in range(2))
        assert pulled == PER_TOKEN * (short + sum(LENGTHS[i] + 1 for i in SHARED)), name
