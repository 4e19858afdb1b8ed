"""The memory model: the paper's figures, KV cache, monotonicity, sharding, config errors, and real
measurements (saved tensors of a tiny model; one training step's peak RSS in a fresh process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from earl_stream.errors import ConfigError
from earl_stream.supervisor.fitting import advise, check_fit, fitting_plans
from earl_stream.supervisor.memory_model import (
    GIB,
    Attention,
    ModelShape,
    Precision,
    Recompute,
    TrainPlan,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    predict_kv_cache_bytes,
    predict_train_memory,
)

LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False}
BENCH = Path(__file__).resolve().parents[2] / "bench" / "memory_model.py"


@pytest.fixture(scope="module")
def llama70b() -> ModelShape:
    return ModelShape.from_hf(LLAMA_70B)


def test_llama70b_eager_grows_by_the_papers_ratio_and_flash_by_two(llama70b: ModelShape) -> None:
    def per_layer(s: int, attn: Attention) -> float:
        return korthikanti_layer_bytes(llama70b, TrainPlan(1, s, attention=attn, precision=Precision.MIXED_BF16))

    eager = per_layer(8192, Attention.EAGER) / per_layer(4096, Attention.EAGER)
    assert eager == pytest.approx(3.65, abs=0.01)
    assert per_layer(8192, Attention.FLASH) / per_layer(4096, Attention.FLASH) == pytest.approx(2.0)
    # The paper's 97 GB / 354 GB are 16 layers of Table 2's sbh(34 + 5as/h) in GiB.
    assert 16 * per_layer(4096, Attention.EAGER) / GIB == pytest.approx(97.0)
    assert 16 * per_layer(8192, Attention.EAGER) / GIB == pytest.approx(354.0)
    # The Llama-adapted model keeps the same shape: super-linear eager, linear flash.
    hf = [layer_activation_bytes(llama70b, TrainPlan(1, s, attention=a, precision=Precision.MIXED_BF16)).saved_bytes
          for a in (Attention.EAGER, Attention.FLASH) for s in (4096, 8192)]
    assert 3.4 < hf[1] / hf[0] < 3.8 and hf[3] / hf[2] == pytest.approx(2.0)


def test_korthikanti_table2_rows(llama70b: ModelShape) -> None:
    s, h, a, t = 4096, 8192, 64, 8
    sbh = s * h
    base = TrainPlan(1, s, attention=Attention.EAGER)
    assert korthikanti_layer_bytes(llama70b, dataclasses.replace(base, tp=t)) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_bytes(llama70b, dataclasses.replace(base, tp=t, sequence_parallel=True)) == pytest.approx(
        sbh / t * (34 + 5 * a * s / h))
    assert korthikanti_layer_bytes(llama70b, dataclasses.replace(
        base, tp=t, sequence_parallel=True, recompute=Recompute.SELECTIVE)) == pytest.approx(sbh / t * 34)
    full = dataclasses.replace(base, recompute=Recompute.FULL)
    assert korthikanti_layer_bytes(llama70b, full) == pytest.approx(2 * sbh)


def test_kv_cache_llama70b_bf16_is_320_kib_per_token(llama70b: ModelShape) -> None:
    assert predict_kv_cache_bytes(llama70b, 1, dtype_bytes=2) == 320 * 1024
    assert predict_kv_cache_bytes(llama70b, 8192, dtype_bytes=2) == 8192 * 320 * 1024
    assert predict_kv_cache_bytes(llama70b, 1, dtype_bytes=2, tp=8) == 40 * 1024


def test_more_tensor_parallel_means_less_memory(llama70b: ModelShape) -> None:
    for sp_flag in (False, True):
        for attn in Attention:
            totals = [predict_train_memory(llama70b, TrainPlan(1, 8192, tp=t, sequence_parallel=sp_flag, attention=attn,
                                                               precision=Precision.MIXED_BF16)).total_bytes
                      for t in (1, 2, 4, 8)]
            assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_recompute_full_lt_selective_lt_none(llama70b: ModelShape) -> None:
    def total(rc: Recompute, s: int) -> int:
        return predict_train_memory(llama70b, TrainPlan(1, s, tp=8, sequence_parallel=True, attention=Attention.EAGER,
                                                        recompute=rc, precision=Precision.MIXED_BF16)).total_bytes

    for s in (4096, 8192, 16384):
        assert total(Recompute.FULL, s) < total(Recompute.SELECTIVE, s) < total(Recompute.NONE, s)
    for s in (4096, 8192):  # the paper's accounting too
        k = [korthikanti_layer_bytes(llama70b, TrainPlan(1, s, attention=Attention.EAGER, recompute=rc))
             for rc in (Recompute.FULL, Recompute.SELECTIVE, Recompute.NONE)]
        assert k == sorted(k) and len(set(k)) == 3


def test_fsdp_shards_states_by_dp_and_ddp_replicates(llama70b: ModelShape) -> None:
    one = predict_train_memory(llama70b, TrainPlan(1, 4096, precision=Precision.MIXED_BF16))
    assert one.static_bytes == pytest.approx(16 * llama70b.num_params(), rel=1e-6)  # ZeRO's 16 bytes/param
    for dp in (2, 4, 8):
        ddp = predict_train_memory(llama70b, TrainPlan(1, 4096, dp=dp, precision=Precision.MIXED_BF16))
        fsdp = predict_train_memory(llama70b, TrainPlan(1, 4096, dp=dp, fsdp=True, precision=Precision.MIXED_BF16))
        assert ddp.static_bytes == one.static_bytes
        for field in ("weights_bytes", "gradients_bytes", "optimizer_bytes"):
            assert getattr(fsdp, field) == pytest.approx(getattr(one, field) / dp, rel=1e-6)


def test_llama_param_count_matches_the_published_size(llama70b: ModelShape) -> None:
    assert llama70b.num_params() == pytest.approx(70.55e9, rel=0.005)


@pytest.mark.parametrize("extra, named", [
    ({"num_experts": 8, "num_experts_per_tok": 2}, "num_experts"),
    ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ({"model_type": "qwen2_moe"}, "qwen2_moe"),
    ({"model_type": "t5"}, "t5"),
    ({"model_type": "no_such_family"}, "no_such_family"),
])
def test_unsupported_architectures_are_named(extra: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ModelShape.from_hf({**LLAMA_70B, **extra})


@pytest.mark.parametrize("extra, quirk", [({"some_new_knob": 3}, "some_new_knob"),
                                          ({"attention_dropout": 0.1}, "attention_dropout")])
def test_unknown_fields_are_quirks_to_calibrate_not_refusals(extra: dict, quirk: str) -> None:
    shape = ModelShape.from_hf({**LLAMA_70B, **extra})
    assert shape.calibrate and any(quirk in q for q in shape.quirks)
    assert not ModelShape.from_hf(LLAMA_70B).calibrate


def test_a_window_is_read_only_where_the_family_defines_one() -> None:
    llama = ModelShape.from_hf({**LLAMA_70B, "sliding_window": 4096})  # LlamaConfig has no such field
    assert (llama.sliding_layers, llama.calibrate) == (0, False)
    mistral = ModelShape.from_hf({**LLAMA_70B, "model_type": "mistral", "sliding_window": 4096})
    assert (mistral.sliding_window, mistral.sliding_layers) == (4096, 80)


def test_missing_fields_are_named_together() -> None:
    cfg = {k: v for k, v in LLAMA_70B.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(ConfigError) as err:
        ModelShape.from_hf(cfg)
    assert "hidden_size" in str(err.value) and "vocab_size" in str(err.value)


def test_real_configs_are_accepted_and_ignore_fields_works() -> None:
    from transformers import LlamaConfig, Qwen2Config

    qwen = ModelShape.from_hf(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=100))
    assert qwen.qkv_bias and qwen.num_kv_heads == 2 and qwen.head_dim == 16
    assert ModelShape.from_hf(LlamaConfig(**{k: v for k, v in LLAMA_70B.items() if k != "model_type"})).num_layers == 80
    assert ModelShape.from_hf({**LLAMA_70B, "my_flag": 1}, ignore_fields=["my_flag"]).hidden_size == 8192
    # Qwen2 ships sliding_window with use_sliding_window=false: not an error.
    ModelShape.from_hf({**LLAMA_70B, "model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False})


def test_advise_says_what_would_be_needed(llama70b: ModelShape) -> None:
    budget = 80 * GIB
    # 8 x 80 GiB cannot hold 70B's AdamW states (16 bytes/param = 131 GiB per device even sharded 8 ways).
    plan = TrainPlan(1, 8192, dp=8, attention=Attention.EAGER, precision=Precision.MIXED_BF16)
    eight = advise(llama70b, plan, budget)
    assert not eight.fits and not eight.alternatives and eight.min_devices == 16
    assert "needs >= 16 devices" in eight.message and "budget of >=" in eight.message
    assert eight.min_budget_bytes > budget
    plan = dataclasses.replace(plan, dp=16)
    adv = advise(llama70b, plan, budget)
    assert not adv.fits and adv.alternatives and "fits with" in adv.message
    assert all(a.fits and a.plan.devices == 16 for a in adv.alternatives)
    good = adv.alternatives[0].plan
    ok = advise(llama70b, good, budget)
    assert ok.fits and ok.message.startswith("fits")
    assert check_fit(llama70b, good, budget).headroom_bytes >= 0
    assert not check_fit(llama70b, good, budget, reserve_bytes=budget).fits
    assert fitting_plans(llama70b, plan, 16, 10**6) == []


def test_invalid_plan_is_refused(llama70b: ModelShape) -> None:
    with pytest.raises(ConfigError, match="tp\\*sp"):
        predict_train_memory(llama70b, TrainPlan(1, 4096, tp=3))


def _saved_bytes(layers: int, attn: str, b: int, s: int, *, autocast: bool = False) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for a tiny Qwen2's loss (`autocast`: under
    bf16 autocast over fp32 weights, its cached bf16 copies of the weights left out: the model counts them as
    weights). SDPA runs as the trainer runs it: the b rows packed into one sequence (`workers.packed_attention`)."""
    import contextlib

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from earl_stream.workers import packed_attention

    torch.manual_seed(0)
    cfg = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=160, vocab_size=96)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation=attn, use_cache=False))
    packed = contextlib.nullcontext()
    if attn == "sdpa":
        model.config._attn_implementation = packed_attention.PACKED
        packed = packed_attention.packed_segments([model], tuple(range(0, b * s + 1, s)))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        cast_weight = t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes
        if st.data_ptr() not in params and not cast_weight:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, 96, (b, s))
    kw = {}
    if attn == "sdpa":
        ids, kw = ids.reshape(1, b * s), {"position_ids": torch.arange(s).repeat(b)[None]}
    with packed, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids, labels=ids, **kw)
    return sum(seen.values())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_per_layer_bytes_equal_what_autograd_saves(attn: str) -> None:
    import torch

    torch.set_num_threads(1)
    b, s = 2, 24
    measured = _saved_bytes(2, attn, b, s) - _saved_bytes(1, attn, b, s)
    shape = ModelShape.from_hf({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160,
                                "vocab_size": 96})
    plan = TrainPlan(b, s, attention=Attention.EAGER if attn == "eager" else Attention.FLASH)
    rsqrt_bytes = 2 * b * s * 4  # the two norms' [b, s, 1] rsqrt, too small to model
    assert layer_activation_bytes(shape, plan).saved_bytes == measured - rsqrt_bytes


def test_per_layer_bytes_under_autocast_equal_what_autograd_saves() -> None:
    """trainer.dtype=bf16 without FSDP: the residual stream and the norms stay fp32 and each linear saves its own
    bf16 cast of its input (2-byte activations everywhere under-predicted SmolLM2's step by ~10%)."""
    import torch

    torch.set_num_threads(1)
    b, s = 2, 24
    measured = _saved_bytes(2, "sdpa", b, s, autocast=True) - _saved_bytes(1, "sdpa", b, s, autocast=True)
    shape = ModelShape.from_hf({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160,
                                "vocab_size": 96})
    plan = TrainPlan(b, s, attention=Attention.FLASH, precision=Precision.AUTOCAST_BF16)
    rsqrt_bytes = 2 * b * s * 4
    assert layer_activation_bytes(shape, plan).saved_bytes == measured - rsqrt_bytes
    # under FSDP its mixed-precision policy gathers bf16 weights: a bf16 stream, as Precision.MIXED_BF16
    fsdp = dataclasses.replace(plan, dp=2, fsdp=True)
    assert layer_activation_bytes(shape, fsdp).saved_bytes == layer_activation_bytes(
        shape, dataclasses.replace(fsdp, precision=Precision.MIXED_BF16)).saved_bytes


def test_one_real_training_step_peak_within_25_percent() -> None:
    """A fresh process: warm-up step, then one forward+backward+AdamW step's peak RSS delta."""
    cfg = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "intermediate_size": 704, "vocab_size": 4096, "tie_word_embeddings": True}
    spec = {"config": cfg, "attn": "eager", "loss": "ce", "seq_len": 256, "micro_batch": 2, "ckpt": False}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    res = subprocess.run([sys.executable, str(BENCH), "--child", json.dumps(spec)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    measured = json.loads(res.stdout.strip().splitlines()[-1])["measured_bytes"]
    shape = ModelShape.from_hf({**cfg, "model_type": "qwen2"})
    predicted = predict_train_memory(shape, TrainPlan(2, 256, attention=Attention.EAGER)).dynamic_bytes
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured)


def test_cost_model_calibration_recovers_coefficients_and_ranks(llama70b: ModelShape) -> None:
    from earl_stream.supervisor.cost_model import StepCostModel, plan_features, rank_plans

    truth = StepCostModel(seconds_per_flop=2e-15, seconds_per_byte=3e-11, seconds_per_score=5e-12, fixed_seconds=0.01)
    plans = [TrainPlan(b, s, dp=dp, tp=t, attention=attn, recompute=rc)
             for b, s, dp, t, attn, rc in [(1, 1024, 1, 1, Attention.EAGER, Recompute.NONE),
                                           (2, 2048, 2, 2, Attention.FLASH, Recompute.FULL),
                                           (1, 4096, 4, 4, Attention.EAGER, Recompute.SELECTIVE),
                                           (4, 512, 8, 1, Attention.FLASH, Recompute.NONE),
                                           (1, 8192, 1, 8, Attention.EAGER, Recompute.FULL)]]
    fitted = StepCostModel.calibrate([(llama70b, p, truth.step_seconds(llama70b, p)) for p in plans])
    for p in plans:
        assert fitted.step_seconds(llama70b, p) == pytest.approx(truth.step_seconds(llama70b, p), rel=1e-6)
    base = TrainPlan(1, 8192, tp=2)
    assert (plan_features(llama70b, dataclasses.replace(base, recompute=Recompute.FULL)).flops
            > plan_features(llama70b, base).flops)
    more_tp = dataclasses.replace(base, tp=4)
    assert plan_features(llama70b, more_tp).comm_bytes > plan_features(llama70b, base).comm_bytes
    plan = TrainPlan(1, 8192, dp=32, attention=Attention.EAGER, precision=Precision.MIXED_BF16)
    ranked = rank_plans(llama70b, fitting_plans(llama70b, plan, 32, 80 * GIB), truth)
    assert ranked and all(r.check.fits for r in ranked)
    assert [r.tokens_per_second for r in ranked] == sorted((r.tokens_per_second for r in ranked), reverse=True)
