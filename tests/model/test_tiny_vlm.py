"""The tiny vision-language models of tests: each family is written with its real classes and
loads back through `AutoModelForImageTextToText` / `AutoProcessor.from_pretrained(dir)`, as a user's checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor

from earl_stream.errors import ModelError
from earl_stream.model.tiny_vlm import init_vlm_model


def test_a_tiny_idefics3_reads_a_picture_through_its_own_processor(tmp_path: Path) -> None:
    d = init_vlm_model(tmp_path / "idefics3", family="idefics3", image_size=64)
    model, processor = AutoModelForImageTextToText.from_pretrained(d), AutoProcessor.from_pretrained(d)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and type(processor).__name__ == "Idefics3Processor"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Your move."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    pictures = [Image.fromarray(np.full((96, 96, 3), v, np.uint8)) for v in (0, 255)]
    outs = []
    for picture in pictures:
        inputs = processor(text=prompt, images=[picture], return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        assert ids.count(model.config.image_token_id) == 4  # (64 / 16)^2 patches, pixel-shuffled by 2 x 2
        with torch.no_grad():
            outs.append(model(**inputs).logits[0, -1])
    assert not torch.allclose(outs[0], outs[1])  # the picture reaches the decoder
    assert init_vlm_model(tmp_path / "again", family="idefics3").joinpath("model.safetensors").read_bytes() == \
        d.joinpath("model.safetensors").read_bytes()


def test_a_tiny_qwen2_5_vl_is_written_with_its_image_processor(tmp_path: Path) -> None:
    d = init_vlm_model(tmp_path / "qwen", family="qwen2_5_vl", image_size=56)
    model = AutoModelForImageTextToText.from_pretrained(d)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    images = AutoImageProcessor.from_pretrained(d)
    grid = images(images=[Image.new("RGB", (96, 96))], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # resized to 56 x 56: 4 x 4 patches of 14 pixels, 4 tokens once merged
    try:
        import torchvision  # noqa: F401
    except ImportError:  # the processor class needs a video processor, which needs torchvision
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(d)
    else:
        assert type(AutoProcessor.from_pretrained(d)).__name__ == "Qwen2_5_VLProcessor"


def test_an_unknown_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not one of"):
        init_vlm_model(tmp_path, family="llava")


def test_a_vision_model_loads_with_its_processor_and_the_text_loader_says_what_it_is(tmp_path: Path) -> None:
    from earl_stream.model import load_model, load_vision_model

    d = init_vlm_model(tmp_path / "v", family="idefics3")
    model, processor = load_vision_model(d)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and not model.training
    assert type(processor).__name__ == "Idefics3Processor"
    with pytest.raises(ModelError, match=r"is a vision-language model \(idefics3\): load it with"):
        load_model(d)
    with pytest.raises(ModelError, match="not a vision-language model"):
        from earl_stream.model.tiny import init_model

        load_vision_model(init_model(tmp_path / "text", num_layers=1, hidden_size=32, intermediate_size=64))


def test_a_3d_rope_family_runs_on_the_built_in_engine_and_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    """Qwen2.5-VL's decoder takes 3-D position ids, which the trainer and the built-in engine lay out: it loads (its
    tokenizer and image processor as its processor) and plans; with vLLM, which is not given them, the supervisor
    refuses it at start (before any worker loads it), in one line naming what runs there; Qwen3-VL is refused."""
    import json

    from earl_stream.config import ModelConfig, RolloutConfig, RunConfig
    from earl_stream.errors import ConfigError
    from earl_stream.model import load_policy
    from earl_stream.model.loading import check_vision_policy
    from earl_stream.model.mrope import MropeProcessor
    from earl_stream.supervisor.planning import Planner

    d = init_vlm_model(tmp_path / "qwen", family="qwen2_5_vl", image_size=56)
    policy = load_policy(d)
    assert type(policy.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert isinstance(policy.processor, MropeProcessor) and policy.tokenizer is policy.processor.tokenizer
    assert Planner(RunConfig(model=ModelConfig(path=str(d)))).shape is not None
    with pytest.raises(ConfigError, match=r"model.path=.*'qwen2_5_vl' .* rollout.engine=torch only.*with vllm, the "
                                          r"families it runs: idefics3, smolvlm"):
        Planner(RunConfig(model=ModelConfig(path=str(d)), rollout=RolloutConfig(engine="vllm")))
    with pytest.raises(ModelError, match=r"'qwen3_vl' is a vision-language model .* interleaved 3-D"):
        check_vision_policy("qwen3_vl")
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen2_5_vl"
