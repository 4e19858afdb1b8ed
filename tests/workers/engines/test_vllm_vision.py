"""A vision-language model served by vLLM (run by `make test-vllm`, skipped where vllm is absent):
a tiny Idefics3 (SmolVLM's architecture) whose prompts `VisionChat` renders from image observations. Greedy tokens
equal `transformers` generate with the same pictures, on the first turn and on a second turn that reaches vLLM's
prefix cache; rows with and without images share a batch; sampled log-probs equal the trainer's forward (the image
token masked out of both); a weight reload reaches the vision tower."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from earl_stream_envs.board_images import tictactoe_picture
from engine_skip import require_engine

from earl_stream.env import Observation
from earl_stream.model.loading import load_vision_model
from earl_stream.model.tiny_vlm import init_vlm_model
from earl_stream.model.vision import VisionChat
from earl_stream.records import SampleImage
from earl_stream.workers.engines import GenerateRequest

pytestmark = pytest.mark.vllm
require_engine("vllm")

from earl_stream.workers.engines.vllm_engine import VllmEngine  # noqa: E402  (after the skip: needs vllm)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, VisionChat]:
    # a wider model than the CPU tests' (head dims of 32: text 128 / 4 heads, tower 64 / 2 heads)
    d = init_vlm_model(tmp_path_factory.mktemp("vlm") / "idefics3", family="idefics3", image_size=64,
                       hidden_size=128, vision_hidden_size=64)
    model, processor = load_vision_model(d)
    return d, model, VisionChat(processor)


@pytest.fixture(scope="module")
def engine(vlm: tuple[Path, Any, VisionChat]) -> Iterator[VllmEngine]:
    with VllmEngine(vlm[0], max_batch_size=8, kv_budget_tokens=2048, seed=0) as eng:
        yield eng


def _board(cells: str) -> Observation:
    return Observation("Your move.", [tictactoe_picture([c if c in "XO" else "" for c in cells])])


def _pixels(chat: VisionChat, images: list[SampleImage]) -> dict[str, torch.Tensor]:
    if not images:
        return {}
    inputs = [chat.prompt_image(i).inputs for i in images]
    return {k: torch.cat([i[k] for i in inputs])[None] for k in ("pixel_values", "pixel_attention_mask")}


def _hf_greedy(model: Any, chat: VisionChat, ids: list[int], images: list[SampleImage], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             **_pixels(chat, images), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             suppress_tokens=[chat.image_token_id])
    return out[0, len(ids):].tolist()


def _request(chat: VisionChat, ids: list[int], images: list[SampleImage], n: int, **kw: Any) -> GenerateRequest:
    return GenerateRequest(ids, n, images=tuple(chat.prompt_image(i) for i in images), **kw)


def test_greedy_turns_with_images_equal_transformers_generate(vlm: tuple[Path, Any, VisionChat],
                                                              engine: VllmEngine) -> None:
    _, model, chat = vlm
    ids, images = chat.first_turn("Play as X.", _board("X...O...."))
    text_ids, _ = chat.first_turn("Play as X.", "A text-only question.")
    other = chat.first_turn("Play as X.", _board("....X...."))
    assert other[0] == ids  # every board lays out alike: only the picture tells them apart
    n = 8
    first, text, third = engine.generate([_request(chat, ids, images, n, temperature=0.0),
                                          GenerateRequest(text_ids, n, temperature=0.0),
                                          _request(chat, *other, n, temperature=0.0)])
    assert list(first.token_ids) == _hf_greedy(model, chat, ids, images, n)
    assert list(text.token_ids) == _hf_greedy(model, chat, text_ids, [], n)
    assert list(third.token_ids) == _hf_greedy(model, chat, *other, n) != list(first.token_ids)
    # the second turn: the first turn's picture and reply, then a new picture (vLLM's prefix cache holds the first)
    nxt, more = chat.next_turn(_board("X...O.X.O"))
    context = ids + list(first.token_ids) + [chat.end_token_id] + nxt
    shift = len(context) - len(nxt)
    both = images + [dataclasses.replace(i, start=i.start + shift) for i in more]
    [second] = engine.generate([_request(chat, context, both, n, temperature=0.0)])
    assert list(second.token_ids) == _hf_greedy(model, chat, context, both, n)


def test_sampled_log_probs_equal_the_trainers_forward(vlm: tuple[Path, Any, VisionChat], engine: VllmEngine) -> None:
    _, model, chat = vlm
    ids, images = chat.first_turn(None, _board("XO..X...O"))
    results = engine.generate([_request(chat, ids, images, 12, temperature=1.0, seed=s) for s in range(4)])
    for res in results:
        assert chat.image_token_id not in res.token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + list(res.token_ids)]), **_pixels(chat, images)).logits[0]
        logits[:, chat.image_token_id] = float("-inf")  # what the trainer leaves out of its log-probs
        ref = torch.log_softmax(logits[len(ids) - 1:-1].float(), dim=-1)
        want = ref.gather(1, torch.tensor(res.token_ids)[:, None]).flatten()
        assert torch.allclose(torch.tensor(res.logprobs), want, atol=1e-4), (res.logprobs, want.tolist())


def test_a_weight_reload_reaches_the_vision_tower(vlm: tuple[Path, Any, VisionChat], engine: VllmEngine) -> None:
    _, model, chat = vlm
    ids, images = chat.first_turn(None, _board("X.O.X.O.X"))
    [before] = engine.generate([_request(chat, ids, images, 8, temperature=0.0)])
    original = {k: v.clone() for k, v in model.state_dict().items()}
    changed = {k: v.clone() for k, v in original.items()}
    gen = torch.Generator().manual_seed(1)
    for name, value in changed.items():
        if ".vision_model." in f".{name}" and value.dtype.is_floating_point:
            value.add_(0.5 * torch.randn(value.shape, generator=gen))
    try:
        engine.load_state_dict(changed, version=1)
        model.load_state_dict(changed)
        [after] = engine.generate([_request(chat, ids, images, 8, temperature=0.0)])
        assert after.policy_version == 1
        assert list(after.token_ids) == _hf_greedy(model, chat, ids, images, 8) != list(before.token_ids)
    finally:
        model.load_state_dict(original)
