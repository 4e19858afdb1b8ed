"""Images in the built-in engine: which vision-language models it runs, and how a prefill hands their images to
the model's forward.

A request's images (`base.PromptImage`) carry their processor tensors one image at a time; a prefill feeds the
vision tower the images whose tokens it runs (those past each row's kept KV, row by row, left to right: the order
in which the model's merger fills the image tokens of its batch), so a multi-turn episode encodes each image
once. It owns `takes_images` (the models it feeds images to; the decode path sends them to the HF forward) and
`vision_inputs`. The images' token layout is the processor's (`model.vision`).

Runs: Idefics3 (SmolVLM) and SmolVLM2 checkpoints: images enter as pixel_values [1, N, 3, H, W] with their
pixel_attention_mask, on 1-D positions. Qwen2-VL / Qwen2.5-VL: patches [P, d] with their grids image_grid_thw, on
3-D positions (`model.mrope`): a prefill's new tokens get theirs from every image of their row (`rope_prefill`,
the images in its kept KV shift the text after them too), and a row then decodes on 1-D positions shifted by
what its images moved its text (`RunningBatch.positions` holds them shifted), as the model's own generate does.
Not yet: Qwen3-VL (interleaved 3-D positions, features fed to several decoder layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from earl_stream.errors import EngineError
from earl_stream.model.loading import VISION_POLICY_TYPES
from earl_stream.model.mrope import MROPE_TYPES, ImageSpan, mrope_positions
from earl_stream.workers.engines.base import PromptImage

__all__ = ["ENGINE_VISION_TYPES", "rope_prefill", "takes_3d_positions", "takes_images", "vision_inputs"]

ENGINE_VISION_TYPES: tuple[str, ...] = (*VISION_POLICY_TYPES, *MROPE_TYPES)
_BATCHED = ("pixel_values", "pixel_attention_mask")  # per-image tensors stacked under one batch row
_PATCHES = ("pixel_values", "image_grid_thw")  # Qwen2-VL: every image's patches, then grids, back to back


def takes_images(model: PreTrainedModel) -> bool:
    """Whether the engine feeds images to `model` (a vision-language family it lays out). Other multimodal
    checkpoints (Gemma 3 4B+, loaded as causal LMs) generate text as any model does."""
    return str(getattr(model.config, "model_type", "")) in ENGINE_VISION_TYPES


def takes_3d_positions(model: PreTrainedModel) -> bool:
    """Whether `model`'s decoder takes 3-D (multimodal RoPE) positions: the Qwen2-VL family."""
    return str(getattr(model.config, "model_type", "")) in MROPE_TYPES


def _spans(model: PreTrainedModel, row: int, offset: int, images: Sequence[PromptImage]) -> list[ImageSpan]:
    merge = int(model.config.vision_config.spatial_merge_size)
    out = []
    for img in images:
        _, h, w = (int(x) for x in img.inputs["image_grid_thw"][0])
        out.append(ImageSpan(row, offset, img.start, img.tokens, h // merge, w // merge))
    return out


def rope_prefill(model: PreTrainedModel, images: Sequence[Sequence[PromptImage]], lengths: Sequence[int],
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([3, S, n] 3-D positions of a prefill's new tokens, [S] each row's shift: its next token's 1-D position less
    its length) for rows whose prompts are `lengths` long and hold `images` (all of them: kept or new), their new
    tokens right-aligned in `positions` [S, n] (each token's position in its prompt)."""
    n = positions.shape[1]
    rows = [_spans(model, b, n - length, imgs) for b, (imgs, length) in enumerate(zip(images, lengths))]
    shift = torch.tensor([sum(s.shift for s in row) for row in rows], dtype=torch.long)
    return mrope_positions(positions, [s for row in rows for s in row]), shift


def vision_inputs(model: PreTrainedModel, images: Sequence[PromptImage], device: torch.device) -> dict[str, torch.Tensor]:
    """The keyword arguments of `model`'s forward for `images` (in the order their tokens appear in the batch)."""
    if not takes_images(model):
        kind = str(getattr(model.config, "model_type", ""))
        raise EngineError(f"the built-in engine feeds images to {ENGINE_VISION_TYPES} models, not {kind!r}")
    if takes_3d_positions(model):
        if any(key not in img.inputs for img in images for key in _PATCHES):
            raise EngineError(f"a Qwen2-VL image carries no {' or '.join(_PATCHES)}")
        dtype = next(model.parameters()).dtype
        return {"pixel_values": torch.cat([img.inputs["pixel_values"] for img in images]).to(device=device, dtype=dtype),
                "image_grid_thw": torch.cat([img.inputs["image_grid_thw"] for img in images]).to(device=device)}
    out: dict[str, torch.Tensor] = {}
    for key in _BATCHED:
        parts = [img.inputs[key] for img in images if key in img.inputs]
        if parts and len(parts) != len(images):
            raise EngineError(f"some images carry {key} and others do not")
        if parts:
            dtype = next(model.parameters()).dtype if key == "pixel_values" else parts[0].dtype
            out[key] = torch.cat(parts, dim=0)[None].to(device=device, dtype=dtype)
    if "pixel_values" not in out:
        raise EngineError("images carry no pixel_values")
    return out
