"""Live calibration of the step cost model: `StepCostModel.fit_steps` on whole training steps, the
Planner's refit from the trainer's reported step times (claims in, PublishVersion metrics in), the
calibration written to `<run_dir>/cost_model.json` and read back through `selector.cost_model_path`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from earl_stream.config import ModelConfig, RunConfig, SelectorConfig, TrainerConfig
from earl_stream.errors import ConfigError
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, metas_to_table, table_to_ipc
from earl_stream.supervisor.cost_model import StepCostModel, plan_features
from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_GRPO, Attention, ModelShape, TrainPlan
from earl_stream.supervisor.planning import Planner, load_cost_model

CONFIG = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 512, "tie_word_embeddings": False}
TRUTH = StepCostModel(seconds_per_flop=1 / 4e9, seconds_per_byte=1e-11, seconds_per_score=1 / 3e8, fixed_seconds=0.01)
REPO = Path(__file__).resolve().parents[1]


def _planner(tmp_path: Path, max_staleness: int = 1, **selector: object) -> Planner:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    cfg = RunConfig(model=ModelConfig(path=str(tmp_path / "model")), run_dir=str(tmp_path / "run"),
                    trainer=TrainerConfig(nproc=1, groups_per_step=2, group_size=4, max_staleness=max_staleness),
                    selector=SelectorConfig(context_window=16, initial_seq_len=256, trainer_memory_bytes=1 << 30,
                                            reserve_bytes=0, **selector))
    return Planner(cfg)


def _claim(step: int, lengths: list[int]) -> bytes:
    metas = [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"s{step}-{i}", prompt_ordinal=step * 2 + i // 4,
                        episode_id=f"s{step}-{i}", group_id=f"g{step}-{i // 4}", env="long_recall", turns=3,
                        prompt_tokens=40, response_tokens=n - 40, total_tokens=n, reward=0.0, advantage=None,
                        policy_version_min=step, policy_version_max=step, producer_id="p", producer_address="x",
                        checksum=0, created_at=0.0, info_json="{}")
             for i, n in enumerate(lengths)]
    return table_to_ipc(metas_to_table(metas))


def test_fit_steps_recovers_the_coefficients_of_whole_steps() -> None:
    shape = ModelShape.from_hf(CONFIG)
    rng = random.Random(0)
    steps = []
    for _ in range(12):
        mbs = [TrainPlan(rng.randint(1, 4), rng.choice((64, 128, 256, 512, 1024)), attention=Attention.EAGER,
                         logit_copies=LOGIT_COPIES_EARL_GRPO) for _ in range(rng.randint(1, 4))]
        steps.append((shape, mbs, TRUTH.predict_step(shape, mbs)))
    fitted = StepCostModel.fit_steps(steps)
    for name in ("seconds_per_flop", "seconds_per_score", "fixed_seconds"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    assert fitted.seconds_per_byte == StepCostModel().seconds_per_byte  # no communication on one rank: kept
    assert fitted.relative_error(steps) < 1e-6 < StepCostModel().relative_error(steps)
    # a single micro-batch per step is what `calibrate` fits: the two agree
    single = [(shape, p, TRUTH.step_seconds(shape, p)) for _, mbs, _ in steps for p in mbs[:1]]
    assert StepCostModel.calibrate(single).seconds_per_flop == pytest.approx(TRUTH.seconds_per_flop, rel=1e-6)
    with pytest.raises(ConfigError, match=">= 2 measured steps"):
        StepCostModel.fit_steps(steps[:1])


def test_planner_refits_from_the_trainers_step_times_and_stores_it(tmp_path: Path) -> None:
    planner = _planner(tmp_path, cost_model_min_steps=4)
    assert planner.status()["cost_model"]["source"] == "defaults"
    rng = random.Random(1)
    adopted = []
    for step in range(9):
        lengths = [rng.randint(60, 240) + 20 * step for _ in range(8)]  # growing contexts, as in a run
        planner.stats.add_many(lengths)
        planner.on_step(step, _claim(step, lengths))
        mbs = planner.micro_batches(lengths)
        # packed (trainer.packing's default): one sequence per micro-batch, its rows' total length
        assert all(p.micro_batch == 1 for p in mbs) and sum(p.seq_len for p in mbs) == sum(lengths)
        unpacked = planner.micro_batches(lengths, packing=False)
        assert sum(p.micro_batch for p in unpacked) == 8 and all(p.seq_len <= 240 + 20 * step for p in unpacked)
        pull = 0.002
        seconds = TRUTH.predict_step(planner.shape, mbs) * (3.0 if step == 0 else 1.0)  # step 0: warm-up
        adopted.append(planner.on_trained(step, {"step_seconds": seconds + pull, "pull_seconds": pull}))
        assert planner.on_trained(step, {"step_seconds": 1.0}) is None  # a repeated report is ignored
    # warm-up step skipped, refit after 4 measured steps (step 4) and 4 more (step 8, where the exact
    # model of step 4 may be kept: a refit is adopted only if it predicts the steps at least as well)
    assert adopted[4] is not None and all(m is None for m in adopted[:4] + adopted[5:8])
    model = planner.cost_model
    assert planner.trainer.cost_model is model
    assert model.seconds_per_flop == pytest.approx(TRUTH.seconds_per_flop, rel=1e-3)
    calibration = planner.status()["cost_model"]
    assert calibration["source"] == "live" and calibration["steps"] == 8 and calibration["step"] == 8
    assert calibration["relative_error"] < 1e-6

    stored = tmp_path / "run" / "cost_model.json"
    assert load_cost_model(stored) == model
    (tmp_path / "again").mkdir()
    again = _planner(tmp_path / "again", cost_model_path=str(stored))
    assert again.trainer.cost_model == model and again.status()["cost_model"]["source"] == str(stored)


def test_cost_model_path_reads_the_benchmark_json_and_refuses_bad_files(tmp_path: Path) -> None:
    bench = REPO / "bench" / "results" / "selector.json"
    if bench.is_file():
        expected = StepCostModel.from_dict(json.loads(bench.read_text())["cost_model"])
        assert _planner(tmp_path, cost_model_path=str(bench)).trainer.cost_model == expected
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"seconds_per_flop": 1e-9, "seconds_per_parsec": 1.0}))
    with pytest.raises(ConfigError, match="seconds_per_parsec"):
        _planner(tmp_path, cost_model_path=str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        _planner(tmp_path, cost_model_path=str(tmp_path / "missing.json"))


def test_a_run_at_staleness_zero_reports_refits_but_never_adopts_them(tmp_path: Path) -> None:
    """At trainer.max_staleness=0 the run is deterministic whatever the load (rollout.batch_invariant): measured
    step times must not pick its plans, so the refit is reported ("held") and the starting model kept."""
    planner = _planner(tmp_path, max_staleness=0, cost_model_min_steps=4)
    start = planner.cost_model
    rng = random.Random(1)
    for step in range(6):
        lengths = [rng.randint(60, 240) for _ in range(8)]
        planner.stats.add_many(lengths)
        planner.on_step(step, _claim(step, lengths))
        seconds = TRUTH.predict_step(planner.shape, planner.micro_batches(lengths))
        assert planner.on_trained(step, {"step_seconds": seconds}) is None
    calibration = planner.status()["cost_model"]
    assert calibration["adopted"] is False and "max_staleness=0" in calibration["held"]
    assert calibration["refit_relative_error"] < calibration["previous_relative_error"]  # it would have helped
    assert planner.cost_model is start and not (tmp_path / "run" / "cost_model.json").exists()


def test_refit_off_with_zero_min_steps(tmp_path: Path) -> None:
    planner = _planner(tmp_path, cost_model_min_steps=0)
    for step in range(6):
        planner.on_step(step, _claim(step, [100] * 8))
        assert planner.on_trained(step, {"step_seconds": 0.5, "pull_seconds": 0.0}) is None
    assert planner.cost_model == StepCostModel()


def test_fit_steps_separates_per_step_per_micro_batch_and_per_collective_costs() -> None:
    """A two-rank pool's steps under dp2, fsdp2, tp2 and sp2 with 1-3 micro-batches: the optimizer's
    per-step constant, a per-micro-batch constant and a per-collective cost are each recovered; from
    one-micro-batch steps alone the constant goes to the step, and the predictions still match."""
    shape = ModelShape.from_hf(CONFIG)
    truth = StepCostModel(seconds_per_flop=1 / 4e9, seconds_per_byte=1 / 1e9, seconds_per_score=1 / 3e8,
                          fixed_seconds=0.02, step_fixed_seconds=0.4, seconds_per_collective=3e-4)
    layouts = [dict(dp=2), dict(dp=2, fsdp=True), dict(tp=2), dict(sp=2)]
    rng = random.Random(2)
    steps = []
    for _ in range(24):
        lay = rng.choice(layouts)
        mbs = [TrainPlan(1, rng.choice((128, 256, 512)), attention=Attention.EAGER, **lay)  # type: ignore[arg-type]
               for _ in range(rng.randint(1, 3))]
        steps.append((shape, mbs, truth.predict_step(shape, mbs)))
    fitted = StepCostModel.fit_steps(steps)
    for name in ("seconds_per_flop", "seconds_per_byte", "fixed_seconds", "step_fixed_seconds", "seconds_per_collective"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-5), name
    single = [(shape, mbs[0], truth.predict_step(shape, mbs[:1])) for _, mbs, _ in steps]
    one = StepCostModel.calibrate(single)
    assert one.fixed_seconds == 0 and one.step_fixed_seconds == pytest.approx(0.42, rel=1e-5)
    assert all(one.predict_step(shape, [p]) == pytest.approx(sec, rel=1e-6) for _, p, sec in single)
    # a calibration stored before these fields existed still loads (they default to 0)
    old = {"seconds_per_flop": 1e-10, "seconds_per_byte": 1e-9, "seconds_per_score": 1e-8, "fixed_seconds": 0.1}
    assert StepCostModel.from_dict(old).step_fixed_seconds == 0.0


def test_fsdp_repeats_are_counted_and_priced_where_they_cost() -> None:
    """FSDP2 gathers and reduce-scatters for every micro-batch: `comm_bytes` counts the states once per step, the
    other micro-batches' share is `fsdp_repeat_bytes`, free on GPUs (overlapped), priced per byte on CPUs."""
    shape = ModelShape.from_hf(CONFIG)
    fsdp, dp = TrainPlan(1, 256, dp=2, fsdp=True), TrainPlan(1, 256, dp=2)
    one, three = (plan_features(shape, fsdp, accumulation_steps=k) for k in (1, 3))
    assert one.fsdp_repeat_bytes == 0 and plan_features(shape, dp, accumulation_steps=3).fsdp_repeat_bytes == 0
    assert three.fsdp_repeat_bytes == pytest.approx(2 * three.comm_bytes)  # all 3 micro-batches move the states
    assert three.comm_bytes + three.fsdp_repeat_bytes == pytest.approx(one.comm_bytes)
    gpu = StepCostModel()
    cpu = gpu.for_device("cpu")
    assert gpu.for_device("cuda") is gpu and cpu.seconds_per_fsdp_repeat_byte == gpu.seconds_per_byte
    extra = cpu.step_seconds(shape, fsdp, accumulation_steps=3) - gpu.step_seconds(shape, fsdp, accumulation_steps=3)
    assert extra == pytest.approx(gpu.seconds_per_byte * three.fsdp_repeat_bytes)
    assert cpu.step_seconds(shape, dp, accumulation_steps=3) == gpu.step_seconds(shape, dp, accumulation_steps=3)
    fitted = StepCostModel(seconds_per_fsdp_repeat_byte=1e-12)
    assert fitted.for_device("cpu") is fitted  # a measured price is kept


def test_fit_steps_recovers_the_price_of_fsdp_repeats() -> None:
    """Steps of 1-3 micro-batches under dp2 and fsdp2: the repeated gathers' price is told apart from the bytes
    counted once per step and from the per-micro-batch constant."""
    shape = ModelShape.from_hf(CONFIG)
    truth = StepCostModel(seconds_per_flop=1 / 4e9, seconds_per_byte=1 / 1e9, seconds_per_score=1 / 3e8,
                          fixed_seconds=0.02, step_fixed_seconds=0.4, seconds_per_collective=3e-4,
                          seconds_per_fsdp_repeat_byte=2 / 1e9)
    rng = random.Random(3)
    steps = []
    for _ in range(30):
        lay = rng.choice([dict(dp=2), dict(dp=2, fsdp=True), dict(tp=2)])
        mbs = [TrainPlan(1, rng.choice((128, 256, 512)), attention=Attention.EAGER, **lay)  # type: ignore[arg-type]
               for _ in range(rng.randint(1, 3))]
        steps.append((shape, mbs, truth.predict_step(shape, mbs)))
    fitted = StepCostModel.fit_steps(steps)
    assert fitted.seconds_per_fsdp_repeat_byte == pytest.approx(truth.seconds_per_fsdp_repeat_byte, rel=1e-5)
    assert fitted.relative_error(steps) < 1e-6


SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}


# A CPU calibration bench/selector.py measured (2026-11-26, in the "cost_model" key of its results file): a
# stored calibration with no measured price for FSDP2's repeated gathers, on which the device decides the plan.
# Written out here, not read from bench/results/selector.json, whose numbers change with each re-measurement.
CPU_CALIBRATION = {"seconds_per_flop": 1.9446124430454496e-11, "seconds_per_byte": 3.232662672138358e-09,
                   "seconds_per_score": 5e-12, "fixed_seconds": 0.20942493855937408,
                   "step_fixed_seconds": 0.14503390873998007, "seconds_per_collective": 0.0}


@pytest.mark.parametrize("device, fsdp", [("cpu", False), ("cuda", True)])
def test_the_cpu_calibration_keeps_dp_where_fsdp_repeats_would_cost(tmp_path: Path, device: str, fsdp: bool) -> None:
    """bench/real_scale.py's phase 1 (SmolLM2-135M, two ranks, a 4.5 GiB cap, design length 256) with a CPU
    calibration (`CPU_CALIBRATION`): on CPU trainers the selector keeps dp2 (measured faster there: FSDP2's
    per-micro-batch gathers overlap nothing under gloo, and the CPU prices them); on GPUs the same coefficients
    still pick fsdp2, whose larger micro-batches pay when its gathers overlap compute."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(SMOLLM2))
    (tmp_path / "selector.json").write_text(json.dumps({"cost_model": CPU_CALIBRATION}))
    cfg = RunConfig(model=ModelConfig(path=str(tmp_path / "model")), run_dir=str(tmp_path / "run"),
                    trainer=TrainerConfig(nproc=2, device=device, groups_per_step=4, group_size=8),
                    selector=SelectorConfig(initial_seq_len=256, trainer_memory_bytes=int(4.5 * 2**30),
                                            cost_model_path=str(tmp_path / "selector.json")))
    planner = Planner(cfg)
    assert planner.trainer is not None and planner.trainer.current is not None
    plan = planner.trainer.current.plan
    assert (plan.dp, plan.fsdp) == (2, fsdp)
    assert (planner.cost_model.seconds_per_fsdp_repeat_byte > 0) == (device == "cpu")
