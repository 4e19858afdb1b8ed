"""Images in the built-in engine: which vision-language models it runs, and how a prefill hands their images to
the model's forward.

A request's images (`base.PromptImage`) carry their processor tensors one image at a time; a prefill feeds the
vision tower the images whose tokens it runs (those past each row's kept KV, row by row, left to right: the order
in which the model's merger fills the image tokens of its batch), so a multi-turn episode encodes each image
once. It owns `is_vision_model` (the decode path sends these to the HF forward), `check_vision_model` (what
the engine can run) and `vision_inputs`. The images' token layout is the processor's (`model.vision`).

Runs: Idefics3 (SmolVLM) and SmolVLM2 checkpoints: images enter as pixel_values [1, N, 3, H, W] with their
pixel_attention_mask, on 1-D positions. Not yet: Qwen2-VL / Qwen2.5-VL / Qwen3-VL, whose multimodal RoPE needs
3-D position ids per row that the engine's batch layout does not carry (vLLM serves them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from earl_stream.errors import EngineError
from earl_stream.workers.engines.base import PromptImage

__all__ = ["ENGINE_VISION_TYPES", "check_vision_model", "is_vision_model", "vision_inputs"]

ENGINE_VISION_TYPES: tuple[str, ...] = ("idefics3", "smolvlm")
_BATCHED = ("pixel_values", "pixel_attention_mask")  # per-image tensors stacked under one batch row


def is_vision_model(model: PreTrainedModel) -> bool:
    """Whether `model` has a vision tower (its config names a vision config)."""
    return getattr(model.config, "vision_config", None) is not None


def check_vision_model(model: PreTrainedModel) -> None:
    """Raise EngineError for a vision-language model the built-in engine cannot feed images to."""
    kind = str(getattr(model.config, "model_type", ""))
    if is_vision_model(model) and kind not in ENGINE_VISION_TYPES:
        raise EngineError(f"the built-in engine runs the vision-language models {ENGINE_VISION_TYPES}, not "
                          f"{kind!r} (its multimodal RoPE positions are not laid out here); serve it with "
                          "rollout.engine=vllm")


def vision_inputs(model: PreTrainedModel, images: Sequence[PromptImage], device: torch.device) -> dict[str, torch.Tensor]:
    """The keyword arguments of `model`'s forward for `images` (in the order their tokens appear in the batch)."""
    check_vision_model(model)
    if not is_vision_model(model):
        raise EngineError("a request carries images and the model has no vision tower")
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
