"""The memory model's vision tower (`model_shape.VisionTower`, `memory_model.vision_activation_bytes`) against what
transformers' Idefics3 tower and connector really save for the backward (saved-tensor hooks, parameters excluded),
and the selector's plans with the image share it observes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from earl_stream.supervisor.memory_model import Attention, Phase, Recompute, TrainPlan, predict_train_memory, vision_activation_bytes
from earl_stream.supervisor.model_shape import ModelShape, VisionTower

TEXT = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def _config(*, layers: int, hidden: int, inter: int, heads: int, image: int, scale: int, attn: str) -> Any:
    cfg = transformers.Idefics3Config(text_config=TEXT, scale_factor=scale, vision_config={
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "image_size": image, "patch_size": 16})
    cfg._attn_implementation = attn
    cfg.vision_config._attn_implementation = attn
    return cfg


def _saved_during(model: Any, backward: Callable[[], None]) -> int:
    """Bytes of the tensors saved for the backward while `backward` runs a forward and its backward (each storage
    once; the parameters, counted as weights, left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backward()
    return sum(seen.values())


def _saved_bytes(model: Any, tiles: int, image: int) -> int:
    """What the tower and connector save for `tiles` tiles of one image."""
    pixels = torch.randn(1, tiles, 3, image, image)
    return _saved_during(model, lambda: model.model.get_image_features(pixels, None, return_dict=True)
                         .pooler_output.sum().backward())


TOWERS = [dict(layers=2, hidden=128, inter=512, heads=4, image=128, scale=2),
          dict(layers=3, hidden=96, inter=192, heads=2, image=192, scale=3)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tower", TOWERS, ids=["h128-s2", "h96-s3"])
def test_the_towers_saved_bytes_per_image_token_are_what_it_saves(tower: dict[str, int], attn: str) -> None:
    cfg = _config(**tower, attn=attn)
    vision = ModelShape.from_hf(cfg).vision
    assert isinstance(vision, VisionTower) and vision.tile_patches == (tower["image"] // 16) ** 2
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(cfg).train()
    for tiles in (1, 3):
        measured = _saved_bytes(model, tiles, tower["image"])
        predicted = tiles * vision.tile_tokens * vision.saved_bytes_per_token(4, eager=attn == "eager",
                                                                              full_recompute=False)
        assert abs(measured - predicted) <= 0.03 * measured, (tiles, measured, predicted)


def test_under_full_recomputation_the_tower_keeps_little_and_the_model_counts_its_layer_inputs() -> None:
    cfg = _config(**TOWERS[0], attn="sdpa")
    vision = ModelShape.from_hf(cfg).vision
    assert vision is not None
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    measured = _saved_bytes(model, 2, TOWERS[0]["image"])
    predicted = 2 * vision.tile_tokens * vision.saved_bytes_per_token(4, eager=False, full_recompute=True)
    full = 2 * vision.tile_tokens * vision.saved_bytes_per_token(4, eager=False, full_recompute=False)
    assert predicted < 0.3 * full
    assert measured <= 1.05 * predicted, (measured, predicted)


def test_a_frozen_tower_saves_nothing_and_the_model_counts_nothing() -> None:
    cfg = _config(**TOWERS[0], attn="sdpa")
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(cfg).train()
    for p in [*model.model.vision_model.parameters(), *model.model.connector.parameters()]:
        p.requires_grad_(False)
    seen: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.numel()) or t, lambda t: t):
        model.model.get_image_features(torch.randn(1, 2, 3, 128, 128), None, return_dict=True)
    assert seen == []
    shape = ModelShape.from_hf(cfg)
    plan = TrainPlan(micro_batch=1, seq_len=1024, image_share=0.5, vision_frozen=True)
    assert vision_activation_bytes(shape, plan) == 0.0


def test_a_plans_peak_carries_the_towers_activations_for_its_image_tokens() -> None:
    shape = ModelShape.from_hf(_config(**TOWERS[0], attn="sdpa"))
    assert shape.vision is not None and not shape.calibrate  # the tower is modelled: no calibration needed
    text = TrainPlan(micro_batch=1, seq_len=2048, attention=Attention.FLASH)
    images = dataclasses.replace(text, image_share=0.25)
    tower = vision_activation_bytes(shape, images)
    assert tower == pytest.approx(512 * shape.vision.saved_bytes_per_token(4, eager=False, full_recompute=False))
    a, b = predict_train_memory(shape, text), predict_train_memory(shape, images)
    assert b.peak_phase is not Phase.OPTIMIZER
    assert b.total_bytes - a.total_bytes == pytest.approx(tower, abs=2)
    # sequence parallel: a rank's share of the image tokens, and up to two tiles it runs whole at its cuts
    sp2 = dataclasses.replace(images, sp=2)
    assert vision_activation_bytes(shape, sp2) == pytest.approx(
        (256 + 2 * shape.vision.tile_tokens) * shape.vision.saved_bytes_per_token(4, eager=False, full_recompute=False))
    rc = dataclasses.replace(images, recompute=Recompute.FULL)
    assert vision_activation_bytes(shape, rc) < 0.3 * tower
    with pytest.raises(Exception, match="image_share"):
        predict_train_memory(shape, dataclasses.replace(text, image_share=1.5))


def test_qwen2_vls_tower_is_not_modelled() -> None:
    """Qwen2-VL's tower (LayerNorm, a GELU MLP, every layer over the whole image) was not measured: `from_config`
    gives None and `ModelShape._vision` marks it a quirk, calibrated from the first measured step."""
    cfg = transformers.Qwen2VLConfig(vision_config={"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64})
    assert VisionTower.from_config(cfg) is None


def test_the_planner_sees_the_episodes_image_share_and_re_plans_what_no_longer_fits(tmp_path: Path) -> None:
    import json
    import time

    from earl_stream.config import ModelConfig, RunConfig, SelectorConfig, TrainerConfig
    from earl_stream.records import IMAGES
    from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
    from earl_stream.supervisor.fitting import check_fit
    from earl_stream.supervisor.planning import Planner, image_share

    cfg = _config(layers=4, hidden=256, inter=1024, heads=4, image=256, scale=2, attn="sdpa")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    run = RunConfig(model=ModelConfig(path=str(tmp_path)), trainer=TrainerConfig(nproc=1, groups_per_step=2, group_size=4),
                    selector=SelectorConfig(context_window=16, initial_seq_len=512, trainer_memory_bytes=160 << 20,
                                            reserve_bytes=0, min_episodes_between=0))
    planner = Planner(run)
    assert planner.trainer is not None and planner.trainer_plan is not None
    first = planner.trainer_plan
    assert first.plan.image_share == 0.0
    # episodes of 512 tokens, half of them image tokens (4 images of 64 tokens)
    info = json.dumps({IMAGES: {"spans": [[10 + 100 * k, 64, 256, 256, 900] for k in range(4)], "crc32": 0}})
    rows = [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"s{i}", prompt_ordinal=i, episode_id=str(i),
                       group_id=f"g{i // 4}", env="e", turns=4, prompt_tokens=400, response_tokens=112, total_tokens=512,
                       reward=0.0, advantage=None, policy_version_min=0, policy_version_max=0, producer_id="w",
                       producer_address="127.0.0.1:1", checksum=0, created_at=time.time(), info_json=info)
            for i in range(16)]
    assert image_share(rows[0]) == 0.5
    planner.add(rows)
    assert planner.trainer.base.image_share == 0.5
    with_images = dataclasses.replace(first.plan, micro_batch=1, seq_len=first.micro_batch_tokens, image_share=0.5)
    budget = planner.trainer.budget_of(first.plan)
    assert not check_fit(planner.trainer.shape, with_images, budget.memory_bytes_per_device,
                         reserve_bytes=budget.reserve_bytes).fits  # the test's premise: the tower breaks the plan
    planner.on_step(1)
    second = planner.trainer_plan
    assert second is not None and second.version > first.version and second.plan.image_share == 0.5
    bound = dataclasses.replace(second.plan, micro_batch=1, seq_len=second.micro_batch_tokens)
    assert check_fit(planner.trainer.shape, bound, budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes).fits
    assert second.micro_batch_tokens >= 512  # it still holds a whole episode


@pytest.mark.parametrize("tower", TOWERS, ids=["h128-s2", "h96-s3"])
def test_the_towers_flops_per_image_token_are_what_it_computes(tower: dict[str, int]) -> None:
    """`VisionTower.flops_per_token` (the cost model's tower term) against torch's FLOP counter on transformers'
    tower and connector: the forward within 5% (norms and activations are not counted on either side), and a
    trainable tower's forward + backward about 3x its forward, as the cost model prices it. Eager attention: the
    counter sees its two products as matmuls (it does not count SDPA's CPU kernel)."""
    from torch.utils.flop_counter import FlopCounterMode

    from earl_stream.supervisor.cost_model import plan_features

    cfg = _config(**tower, attn="eager")
    shape = ModelShape.from_hf(cfg)
    vision = shape.vision
    assert vision is not None
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(cfg).train()
    for tiles in (1, 3):
        pixels = torch.randn(1, tiles, 3, tower["image"], tower["image"])
        with FlopCounterMode(display=False) as forward:
            out = model.model.get_image_features(pixels, None, return_dict=True).pooler_output
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
        predicted = tiles * vision.tile_tokens * vision.flops_per_token(cfg.text_config.hidden_size)
        measured = forward.get_total_flops()
        assert abs(measured - predicted) <= 0.05 * measured, (tiles, measured, predicted)
        assert 1.8 <= backward.get_total_flops() / measured <= 2.2
    # the cost model adds the tower's compute for the image tokens of a micro-batch, once if frozen
    plan = TrainPlan(micro_batch=1, seq_len=4 * vision.tile_tokens, image_share=0.5)
    text_only = plan_features(shape, dataclasses.replace(plan, image_share=0.0)).flops
    tower_flops = 2 * vision.tile_tokens * vision.flops_per_token(cfg.text_config.hidden_size)
    assert plan_features(shape, plan).flops - text_only == pytest.approx(3 * tower_flops)
    frozen = dataclasses.replace(plan, vision_frozen=True)
    assert plan_features(shape, frozen).flops - text_only == pytest.approx(tower_flops)


def _qwen_config(*, layers: int, hidden: int, inter: int, heads: int, attn: str) -> Any:
    text = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2,  # (not TEXT: Idefics3Config writes its model_type in)
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}}
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config={
        "depth": layers, "hidden_size": hidden, "intermediate_size": inter, "num_heads": heads, "out_hidden_size": 64,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [layers - 1]})
    cfg._attn_implementation = attn
    cfg.vision_config._attn_implementation = attn
    return cfg


def _qwen_saved_bytes(model: Any, grid: tuple[int, int, int]) -> int:
    """What Qwen2.5-VL's tower and merger save for one image of `grid` (temporal, rows, columns) patches."""
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 14 * 14)

    def run() -> None:
        out = model.model.get_image_features(pixels, torch.tensor([grid]), return_dict=True).pooler_output
        torch.cat(list(out)).sum().backward()

    return _saved_during(model, run)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tower", [dict(layers=2, hidden=64, inter=128, heads=2), dict(layers=3, hidden=96, inter=192,
                                                                                      heads=4)], ids=["h64", "h96"])
def test_qwen2_5_vl_towers_saved_bytes_are_what_it_saves(tower: dict[str, int], attn: str) -> None:
    """Qwen2.5-VL's windowed tower (8 x 8-patch windows, its last layer over the whole image) and merger: per image
    token, for images of one window, four windows and a wide one, within 1% (sdpa and eager)."""
    cfg = _qwen_config(**tower, attn=attn)
    shape = ModelShape.from_hf(cfg)
    vision = shape.vision
    assert vision is not None and vision.family == "qwen2_vl" and vision.tile_patches == 64 and not shape.calibrate
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).train()
    for grid in ((1, 8, 8), (1, 16, 16), (1, 8, 24)):
        patches = grid[1] * grid[2]
        measured = _qwen_saved_bytes(model, grid)
        predicted = patches // 4 * vision.saved_bytes_per_token(4, eager=attn == "eager", full_recompute=False,
                                                                image_patches=patches)
        assert abs(measured - predicted) <= 0.01 * measured, (grid, measured, predicted)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kept = _qwen_saved_bytes(model, (1, 16, 16))
    assert kept <= 1.05 * 64 * vision.saved_bytes_per_token(4, eager=attn == "eager", full_recompute=True)
