"""What transformers' own forward of a vision-language model takes for a prompt's pictures: the reference the
engine's and the trainer's image paths are compared with (tests of both families share it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def hf_image_kwargs(chat: Any, input_ids: torch.Tensor, prompts: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Keyword arguments of the model's forward (or generate) for the `PromptImage`s `prompts` of one row
    `input_ids` [1, n]: Idefics3, every tile's pixels and masks under one batch row; Qwen2.5-VL, the patches, their
    grids and which tokens are image tokens (from which the model lays out its own 3-D positions)."""
    pixels = torch.cat([p.inputs["pixel_values"] for p in prompts])
    if chat.mrope:
        return {"pixel_values": pixels, "image_grid_thw": torch.cat([p.inputs["image_grid_thw"] for p in prompts]),
                "mm_token_type_ids": (input_ids == chat.image_token_id).int()}
    return {"pixel_values": pixels[None],
            "pixel_attention_mask": torch.cat([p.inputs["pixel_attention_mask"] for p in prompts])[None]}
