"""Images in the built-in engine: which vision-language models it runs, and how a prefill hands their images to
the model's forward.

A request's images (`base.PromptImage`) carry their processor tensors one image at a time; a prefill feeds the
vision tower the images whose tokens it runs (those past each row's kept KV, row by row, left to right: the order
in which the model's merger fills the image tokens of its batch), so a multi-turn episode encodes each image
once. It owns `takes_images` (the models it feeds images to; the decode path sends them to the HF forward) and
`vision_inputs`. The images' token layout is the processor's (`model.vision`).

Runs: Idefics3 (SmolVLM) and SmolVLM2 checkpoints: images enter as pixel_values [1, N, 3, H, W] with their
pixel_attention_mask, on 1-D positions. Not yet: Qwen2-VL / Qwen2.5-VL / Qwen3-VL, whose multimodal RoPE needs
3-D position ids per row (and, decoding, each row's shift from its images) that the engine's batch layout does not
carry; the trainer lays them out (`model.mrope`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from earl_stream.errors import EngineError
from earl_stream.model.loading import VISION_POLICY_TYPES
from earl_stream.workers.engines.base import PromptImage

__all__ = ["ENGINE_VISION_TYPES", "takes_images", "vision_inputs"]

ENGINE_VISION_TYPES: tuple[str, ...] = VISION_POLICY_TYPES
_BATCHED = ("pixel_values", "pixel_attention_mask")  # per-image tensors stacked under one batch row


def takes_images(model: PreTrainedModel) -> bool:
    """Whether the engine feeds images to `model` (a vision-language family it lays out). Other multimodal
    checkpoints (Gemma 3 4B+, loaded as causal LMs) generate text as any model does."""
    return str(getattr(model.config, "model_type", "")) in ENGINE_VISION_TYPES


def vision_inputs(model: PreTrainedModel, images: Sequence[PromptImage], device: torch.device) -> dict[str, torch.Tensor]:
    """The keyword arguments of `model`'s forward for `images` (in the order their tokens appear in the batch)."""
    if not takes_images(model):
        kind = str(getattr(model.config, "model_type", ""))
        raise EngineError(f"the built-in engine feeds images to {ENGINE_VISION_TYPES} models, not {kind!r}: Qwen2-VL "
                          "and its kin need 3-D RoPE positions the engine does not lay out")
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
