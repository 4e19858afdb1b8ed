"""Vision-language models in the built-in engine: a tiny Idefics3 (SmolVLM's architecture), a tiny Qwen2.5-VL, a tiny
Qwen2-VL (3-D positions: `model.mrope`), their prompts rendered by `VisionChat` from image observations. Greedy tokens equal
`transformers` generate with the same images; a second turn reuses the first turn's KV (its image is not encoded
again) and still equals generate over the whole two-turn context; rows with and without images share a batch; a
request with images to a text-only model, or with images that leave its prompt, is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from earl_stream_envs.board_images import tictactoe_picture
from transformers import AutoModelForImageTextToText
from vlm_inputs import hf_image_kwargs

from earl_stream.env import Observation
from earl_stream.env.images import decode_image
from earl_stream.errors import EngineError
from earl_stream.model.tiny_vlm import init_vlm_model
from earl_stream.model.vision import VisionChat
from earl_stream.records import SampleImage
from earl_stream.workers.engines.base import GenerateRequest, PromptImage
from earl_stream.workers.engines.torch_engine import TorchEngine


@pytest.fixture(scope="module", params=["idefics3", "qwen2_5_vl", "qwen2_vl"])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    from earl_stream.model.loading import load_processor

    size = 64 if request.param == "idefics3" else 56
    d = init_vlm_model(tmp_path_factory.mktemp("vlm") / request.param, family=request.param, image_size=size)
    model = AutoModelForImageTextToText.from_pretrained(d).eval()
    return model, load_processor(d)


def _board(cells: str) -> Observation:
    return Observation("Your move.", [tictactoe_picture([c if c in "XO" else "" for c in cells])])


def _hf_greedy(model: object, chat: VisionChat, ids: list[int], images: list[SampleImage], n: int) -> list[int]:
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if images:
        inputs.update(hf_image_kwargs(chat, inputs["input_ids"], [chat.prompt_image(i) for i in images]))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None)  # type: ignore[attr-defined]
    return out[0, len(ids):].tolist()


def _prompt(chat: VisionChat, images: list[SampleImage]) -> tuple[PromptImage, ...]:
    return tuple(chat.prompt_image(i) for i in images)


def test_greedy_tokens_with_images_equal_transformers_generate_across_turns(vlm: tuple[object, object]) -> None:
    model, processor = vlm
    chat = VisionChat(processor)
    ids, images = chat.first_turn("Play as X.", _board("X...O...."))
    assert len(images) == 1 and ids[images[0].start] == chat._around and ids.count(chat.image_token_id) == 4
    whole = processor(text=chat.chat.first_turn_text("Play as X.", [{"type": "image"}, {"type": "text", "text": "Your move."}]),
                      images=[decode_image(_board("X...O....").images[0])], add_special_tokens=False)
    assert ids == list(whole["input_ids"][0])  # the pieces are the processor's own rendering
    engine = TorchEngine(model, seed=0)  # type: ignore[arg-type]
    assert engine.decode_path.path.value == "hf_forward"
    n = 6
    [first] = engine.generate([GenerateRequest(ids, n, temperature=0.0, cache_key="ep", images=_prompt(chat, images))])
    assert list(first.token_ids) == _hf_greedy(model, chat, ids, images, n)
    nxt, more = chat.next_turn(_board("X...O.X.O"))
    context = ids + list(first.token_ids) + [chat.end_token_id] * (first.token_ids[-1] not in chat.stop_token_ids) + nxt
    shift = len(context) - len(nxt)
    all_images = images + [dataclasses.replace(i, start=i.start + shift) for i in more]
    before = engine.stats
    [second] = engine.generate([GenerateRequest(context, n, temperature=0.0, cache_key="ep",
                                                images=_prompt(chat, all_images))])
    after = engine.stats
    assert after.reused_tokens - before.reused_tokens >= len(ids)  # the first turn (its image too) was not run again
    assert after.prefill_tokens - before.prefill_tokens <= len(context) - len(ids)
    assert list(second.token_ids) == _hf_greedy(model, chat, context, all_images, n)


def test_rows_with_and_without_images_share_a_batch(vlm: tuple[object, object]) -> None:
    model, processor = vlm
    chat = VisionChat(processor)
    a_ids, a_img = chat.first_turn(None, _board("XO......."))
    b_ids, _ = chat.first_turn(None, "A text-only question.")
    c_ids, c_img = chat.first_turn(None, _board("....X...."))
    engine = TorchEngine(model, seed=0)  # type: ignore[arg-type]
    reqs = [GenerateRequest(a_ids, 5, temperature=0.0, images=_prompt(chat, a_img)),
            GenerateRequest(b_ids, 5, temperature=0.0), GenerateRequest(c_ids, 5, temperature=0.0, images=_prompt(chat, c_img)),
            GenerateRequest(c_ids, 5, temperature=0.0, images=_prompt(chat, a_img))]  # the ids of every board are alike
    results = engine.generate(reqs)
    got = [list(r.token_ids) for r in results]
    want = [_hf_greedy(model, chat, a_ids, a_img, 5), _hf_greedy(model, chat, b_ids, [], 5),
            _hf_greedy(model, chat, c_ids, c_img, 5), _hf_greedy(model, chat, c_ids, a_img, 5)]
    assert got == want and a_ids == c_ids
    assert list(results[0].logprobs) != list(results[2].logprobs)  # the picture alone tells a from c
    assert engine.stats.shared_prefix_tokens == len(a_ids)  # request 3 (a's ids and picture) shares a's prefill, not c's


def test_images_a_model_cannot_take_are_refused(vlm: tuple[object, object], tiny_model_dir: Path) -> None:
    from earl_stream.model import load_model

    model, processor = vlm
    chat = VisionChat(processor)
    ids, shown = chat.first_turn(None, _board("........."))
    images = _prompt(chat, shown)
    engine = TorchEngine(model, seed=0)  # type: ignore[arg-type]
    outside = PromptImage(len(ids) - 2, 5, images[0].inputs, images[0].key)
    with pytest.raises(EngineError, match="leave the"):
        engine.generate([GenerateRequest(ids, 3, images=(outside,))])
    text_model, _ = load_model(tiny_model_dir)
    with pytest.raises(EngineError, match="feeds images to .* models only"):
        TorchEngine(text_model, seed=0).generate([GenerateRequest([1, 2, 3], 2, images=tuple(images))])
    assert np.isfinite(images[0].inputs["pixel_values"].numpy()).all()


def test_a_multimodal_checkpoint_loaded_as_a_causal_lm_still_generates_text(tmp_path: Path) -> None:
    """Gemma 3 4B+ checkpoints are multimodal (a vision config) and load as causal LMs: the engine runs them as
    text models, as before images were built (it feeds images to Idefics3/SmolVLM only)."""
    import transformers

    text = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16}
    config = transformers.Gemma3Config(text_config=text, vision_config={"hidden_size": 16, "intermediate_size": 32,
                                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                                       "patch_size": 14}, mm_tokens_per_image=4)
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path / "g3")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "g3").eval()
    assert model.config.vision_config is not None
    ids = [5, 17, 42, 9, 11]
    [got] = TorchEngine(model, seed=0).generate([GenerateRequest(ids, 6, temperature=0.0)])
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(ids):]
    assert list(got.token_ids) == want.tolist()
