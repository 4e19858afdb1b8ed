"""Qwen2-VL-family 3-D RoPE positions (`model.mrope`): laid out from each image's span and size alone, they equal
the model's own `get_rope_index` over a whole sample, over any slice of it (a sequence-parallel rank's window) and
in packed rows; `MropeProcessor` expands each image into one pad per merged patch, as the model's processor does,
and `VisionChat` finds each image's span between its markers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from earl_stream.env import Observation
from earl_stream.errors import ModelError
from earl_stream.model.mrope import ImageSpan, image_grid, mrope_positions

SIZES = [(56, 56), (56, 140), (100, 60), (30, 90)]  # (height, width): grids 2x2, 1x4, 4x2, ...


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    from earl_stream.model import load_policy
    from earl_stream.model.tiny_vlm import init_vlm_model

    d: Path = init_vlm_model(tmp_path_factory.mktemp("qwen") / "m", family="qwen2_5_vl", image_size=56)
    policy = load_policy(d)
    return policy.model, policy.processor


def _pictures() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]


def test_positions_equal_the_models_own_whole_sliced_and_packed(qwen: tuple[object, object]) -> None:
    from earl_stream.model.vision import VisionChat

    model, processor = qwen
    chat = VisionChat(processor)
    pics = _pictures()
    ids, images = chat.first_turn("Look.", Observation("two boards", pics[:2]))
    more, second = chat.next_turn(Observation("and two more", pics[2:]))
    images += [type(s)(s.start + len(ids) + 3, s.tokens, s.image) for s in second]
    ids = ids + [7, 8, chat.end_token_id] + more
    x = torch.tensor([ids])
    grids = torch.cat([chat.prompt_image(i).inputs["image_grid_thw"] for i in images])
    ref, _ = model.model.get_rope_index(x, (x == chat.image_token_id).int(), image_grid_thw=grids)  # type: ignore[attr-defined]
    ip = processor.image_processor  # type: ignore[attr-defined]
    spans = [ImageSpan(0, 0, i.start, i.tokens, *image_grid(ip, i.image.width, i.image.height)) for i in images]
    assert [(s.rows, s.cols) for s in spans] == [(h // 2, w // 2) for _, h, w in grids.tolist()]
    assert len({(s.rows, s.cols) for s in spans}) > 2  # grids of several shapes, wider and taller
    n = len(ids)
    assert torch.equal(mrope_positions(torch.arange(n)[None], spans), ref)
    for a in range(0, n, 5):  # every window of 9: slices that cut images, and slices after them
        b = min(n, a + 9)
        shifted = [ImageSpan(0, -a, s.start, s.tokens, s.rows, s.cols) for s in spans]
        assert torch.equal(mrope_positions(torch.arange(a, b)[None], shifted), ref[:, :, a:b]), (a, b)
    # packed: the sample twice in one row (positions restart), then as a second batch row
    pos = torch.cat([torch.arange(n), torch.arange(n)])[None]
    twice = spans + [ImageSpan(0, n, s.start, s.tokens, s.rows, s.cols) for s in spans]
    assert torch.equal(mrope_positions(pos, twice), torch.cat([ref, ref], 2))
    rows = torch.stack([torch.arange(n), torch.arange(n)])
    only_second = [ImageSpan(1, 0, s.start, s.tokens, s.rows, s.cols) for s in spans]
    got = mrope_positions(rows, only_second)
    assert torch.equal(got[:, 1], ref[:, 0]) and torch.equal(got[:, 0], torch.arange(n).expand(3, n))


def test_a_span_that_is_not_its_grid_is_refused() -> None:
    with pytest.raises(ModelError, match="span holds 5 tokens, not its 2x2 grid's 4"):
        mrope_positions(torch.arange(10)[None], [ImageSpan(0, 0, 1, 5, 2, 2)])


def test_the_processor_expands_each_image_into_its_merged_patches(qwen: tuple[object, object]) -> None:
    from PIL import Image

    _, processor = qwen
    text = "a <|vision_start|><|image_pad|><|vision_end|> b <|vision_start|><|image_pad|><|vision_end|>"
    images = [Image.fromarray(p) for p in _pictures()[:2]]
    out = processor(text=text, images=images)  # type: ignore[operator]
    ids = out["input_ids"][0].tolist()
    pads = [(h // 2) * (w // 2) for _, h, w in out["image_grid_thw"].tolist()]
    assert ids.count(processor.pad_id) == sum(pads)  # type: ignore[attr-defined]
    assert out["pixel_values"].shape[0] == 4 * sum(pads)  # 2x2 patches per merged one
    with pytest.raises(ModelError, match="1 image placeholder"):
        processor(text="a <|vision_start|><|image_pad|><|vision_end|>", images=images)  # type: ignore[operator]
