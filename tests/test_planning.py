"""The supervisor's Planner and the trainer's plan plumbing: sequence parallelism chosen when data
parallel no longer fits, a decision turned into a rank's plan, a stored cost-model calibration, and
the token alignment of a sequence-parallel shard (the equivalence of the math across plans is
tests/test_parallel_equivalence.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from earl_stream.config import ModelConfig, RunConfig, SelectorConfig, TrainerConfig
from earl_stream.errors import ConfigError
from earl_stream.supervisor.cost_model import StepCostModel
from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_GRPO, Attention, ModelShape, TrainPlan
from earl_stream.supervisor.planning import Planner
from earl_stream.workers.batches import shard_batch
from earl_stream.workers.mesh import Placement, RankPlan
from earl_stream.workers.sharding import apply_plan

CONFIG = {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 16,
          "num_key_value_heads": 4, "intermediate_size": 688, "vocab_size": 512, "tie_word_embeddings": True}
MIB = 1 << 20


def _planner(tmp_path: Path, *, nproc: int, memory: int, cost_model: StepCostModel | None = None) -> Planner:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    cfg = RunConfig(model=ModelConfig(path=str(tmp_path)),
                    trainer=TrainerConfig(nproc=nproc, groups_per_step=2, group_size=4),
                    selector=SelectorConfig(context_window=16, initial_seq_len=256, trainer_memory_bytes=memory,
                                            reserve_bytes=0, min_episodes_between=0))
    return Planner(cfg, cost_model=cost_model)


def test_two_ranks_switch_to_sequence_parallel_when_data_parallel_no_longer_fits(tmp_path: Path) -> None:
    planner = _planner(tmp_path, nproc=2, memory=600 * MIB)
    assert planner.trainer_plan is not None and planner.trainer_plan.plan.sp == 1
    planner.stats.add_many([1500] * 16)  # one 2048-token sequence needs 0.83 GiB on one rank even with recompute
    planner.on_step(1)
    decision = planner.trainer_plan
    assert decision.design_seq_len == 2048 and decision.plan.sp == 2 and decision.plan.dp == 1, decision
    rank = RankPlan.from_wire(decision.to_wire())
    assert rank.sp == 2 and rank.micro_batch_tokens == decision.micro_batch_tokens // 2
    assert rank.recompute == (decision.plan.recompute.value == "full")


def test_one_rank_never_gets_sequence_parallel(tmp_path: Path) -> None:
    planner = _planner(tmp_path, nproc=1, memory=300 * MIB)
    planner.stats.add_many([700] * 16)  # design 1024: only recomputation fits 300 MiB
    planner.on_step(1)
    assert planner.trainer_plan.plan.sp == 1 and planner.last_infeasible == ""
    assert planner.trainer_plan.plan.recompute.value == "full"


def test_cost_model_calibration_is_stored_and_used(tmp_path: Path) -> None:
    shape = ModelShape.from_hf(CONFIG)
    plans = [TrainPlan(b, s, attention=Attention.EAGER, logit_copies=LOGIT_COPIES_EARL_GRPO)
             for s in (128, 256) for b in (1, 2)]
    truth = StepCostModel(seconds_per_flop=1 / 20e9, seconds_per_byte=1 / 1e9, seconds_per_score=1 / 1e8,
                          fixed_seconds=0.05)
    fitted = StepCostModel.calibrate([(shape, p, truth.step_seconds(shape, p)) for p in plans])
    stored = StepCostModel.from_dict(json.loads(json.dumps(fitted.to_dict())))
    assert stored == fitted
    for p in plans:
        assert stored.step_seconds(shape, p) == pytest.approx(truth.step_seconds(shape, p), rel=1e-6)
    planner = _planner(tmp_path, nproc=1, memory=300 * MIB, cost_model=stored)
    assert planner.trainer.cost_model == stored
    assert planner.trainer_plan.predicted_tokens_per_s == pytest.approx(
        stored.tokens_per_second(shape, planner.trainer_plan.plan, accumulation_steps=max(
            1, -(-8 // planner.trainer_plan.plan.micro_batch))), rel=1e-9)
    with pytest.raises(ConfigError, match="unknown cost-model fields"):
        StepCostModel.from_dict({"seconds_per_flop": 1.0, "flops_per_watt": 2.0})


def test_sequence_parallel_shards_cover_every_next_token_once() -> None:
    ids = torch.arange(1, 12).reshape(1, 11)  # 11 tokens over 3 ranks: padded to 12
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(1, 11),
             "behaviour_logprobs": ids.float() / 10, "advantages": torch.tensor([0.5])}
    parts = [shard_batch(batch, 3, r) for r in range(3)]
    assert torch.cat([p["input_ids"] for p in parts], 1).tolist() == [[*range(1, 12), 0]]
    assert torch.cat([p["position_ids"] for p in parts], 1).tolist() == [list(range(12))]
    # position i's logits score token i+1: the labels and loss tensors are shifted by one
    assert torch.cat([p["labels"] for p in parts], 1).tolist() == [[*range(2, 12), 0, 0]]
    assert torch.cat([p["loss_mask"] for p in parts], 1).tolist() == [[1.0] * 10 + [0.0, 0.0]]
    assert torch.cat([p["behaviour_logprobs"] for p in parts], 1)[0, :10].tolist() == pytest.approx(
        [i / 10 for i in range(2, 12)])
    assert all(p["advantages"].tolist() == [0.5] for p in parts)


def test_a_sequence_parallel_plan_needs_a_pool(tiny_model_dir: Path) -> None:
    from earl_stream.model import load_model

    model, _ = load_model(tiny_model_dir)
    with pytest.raises(ConfigError, match="sp=2"):
        apply_plan(model, Placement(plan=RankPlan(sp=2), layout=RankPlan(sp=2).layout(0)))
    apply_plan(model, Placement(plan=RankPlan(recompute=True), layout=RankPlan().layout(0)))
    assert model.is_gradient_checkpointing
    apply_plan(model, Placement.single())
    assert not model.is_gradient_checkpointing


def test_pad_aware_budget_weighs_padding_against_per_pass_overhead() -> None:
    from earl_stream.supervisor.context_stats import ContextStats
    from earl_stream.supervisor.selector import PoolBudget, Thresholds, TrainerSelector

    shape = ModelShape.from_hf(CONFIG)
    base = TrainPlan(1, 256, attention=Attention.EAGER, logit_copies=LOGIT_COPIES_EARL_GRPO)
    stats = ContextStats(32)
    stats.add_many(range(100, 200, 3))  # p50 / p99 ~ 0.75: a padded micro-batch of several rows wastes ~25%

    def choose(fixed_seconds: float, pad_aware: bool) -> int:
        model = StepCostModel(seconds_per_flop=1 / 20e9, seconds_per_score=1 / 1e8, fixed_seconds=fixed_seconds)
        sel = TrainerSelector(shape, PoolBudget(1, 300 * MIB), base=base, cost_model=model, allow_tp=False,
                              allow_sp=False, allow_fsdp=False, step_sequences=8, pad_aware=pad_aware,
                              thresholds=Thresholds(min_episodes=16))
        decision = sel.decide(stats.snapshot(), step=1)
        assert decision is not None and decision.design_seq_len == 256
        return decision.micro_batch_tokens

    largest = choose(0.0, pad_aware=False)
    assert largest > 512
    assert choose(0.0, pad_aware=True) == 256  # time linear in tokens: padding is pure waste
    assert choose(5.0, pad_aware=True) >= largest  # a large cost per pass: fewer, fuller passes win


def test_a_sequence_parallel_rank_pulls_only_its_slice() -> None:
    import numpy as np

    from earl_stream.workers.batches import batch_tensors, local_batch, sp_token_ranges, sp_windows

    lengths = [11, 7, 3]
    rng = np.random.default_rng(0)
    rows = [{"input_ids": rng.integers(0, 50, n).astype(np.int32), "loss_mask": (rng.random(n) < 0.7).astype(np.uint8),
             "behaviour_logprobs": -rng.random(n).astype(np.float32)} for n in lengths]
    adv = np.array([0.5, -1.0, 0.25], dtype=np.float32)
    full = batch_tensors(rows, adv)
    mbs = [[0, 1, 2]]
    for r in range(3):
        windows = sp_windows(mbs, lengths, 3, r)
        ranges = sp_token_ranges(mbs, lengths, windows)
        pulled = [{k: v[slice(*ranges[i][0])] for k, v in row.items()} for i, row in enumerate(rows)]
        assert sum(len(p["input_ids"]) for p in pulled) <= sum(lengths) // 3 + 2 * len(lengths)
        got, want = local_batch(pulled, adv, windows[0]), shard_batch(full, 3, r)
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k].to(got[k].dtype)), (r, k)


def test_selector_attention_flash_sizes_plans_without_the_score_matrix(tmp_path: Path) -> None:
    """`selector.attention=flash` (bf16 sdpa on a GPU, measured in bench/memory_model.py part e): the same
    long contexts on one rank need no recomputation and get a larger micro-batch budget than under
    eager sizing, which stores the s x s scores."""
    from earl_stream.config import load_config

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    decisions = {}
    for attention in ("eager", "flash"):
        cfg = load_config(None, [f"model.path={tmp_path}", f"run_dir={tmp_path / attention}", "trainer.nproc=1",
                                 "selector.context_window=16", "selector.initial_seq_len=256",
                                 f"selector.trainer_memory_bytes={300 * MIB}", "selector.reserve_bytes=0",
                                 "selector.min_episodes_between=0", f"selector.attention={attention}"])
        planner = Planner(cfg)
        planner.stats.add_many([700] * 16)  # design 1024
        planner.on_step(1)
        decisions[attention] = planner.trainer_plan
    eager, flash = decisions["eager"], decisions["flash"]
    assert eager.plan.attention is Attention.EAGER and flash.plan.attention is Attention.FLASH
    assert eager.plan.recompute.value == "full" and flash.plan.recompute.value == "none"
    assert flash.micro_batch_tokens >= eager.micro_batch_tokens
    with pytest.raises(ConfigError, match=r"selector\.attention: 'sdpa' is not allowed; choose one of eager, flash"):
        load_config(None, ["selector.attention=sdpa"])
