"""Qwen2-VL-family vision-language models (Qwen2-VL, Qwen2.5-VL): their processing and their 3-D RoPE positions.

Their decoder rotates each token by three positions (temporal, height, width): a text token's three are equal; an
image's tokens (one `<|image_pad|>` per merged patch, between `<|vision_start|>` and `<|vision_end|>`) take the
patch's grid coordinates from the position where the image starts, and the text after an image continues from the
image's largest coordinate plus one: each image shifts the text after it by max(rows, columns) - its tokens. So a
token's three positions follow from its position in its sample and the grids of the sample's images before it:
`mrope_positions` lays them out for any slice of a sample (a sequence-parallel rank's, a packed row's), from the
images' sizes alone, without their pixels (`ImageSpan`: what a sample's metadata records of each image).

`MropeProcessor` renders these models' text and images with the tokenizer and the image processor: their own
processor class also builds a video processor, which transformers builds only with torchvision installed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch

from earl_stream.errors import ModelError

__all__ = ["MROPE_TYPES", "ImageSpan", "MropeProcessor", "image_grid", "mrope_positions"]

MROPE_TYPES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl")  # families whose decoder takes 3-D positions
START, PAD, END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """An image of a sample in a micro-batch: batch `row`, `offset` (local column = offset + sample position),
    the image's span [start, start + tokens) in its sample (`<|vision_start|>`, the pads, `<|vision_end|>`) and
    its merged patch grid (`rows` x `cols` pads)."""

    row: int
    offset: int
    start: int
    tokens: int
    rows: int
    cols: int

    @property
    def shift(self) -> int:
        """How far the image moves the positions of the text after it: max(rows, cols) less its tokens."""
        return max(self.rows, self.cols) - self.rows * self.cols


def image_grid(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """(rows, columns) of merged patches the Qwen2-VL image processor `image_processor` makes of a width x height
    picture (its resize: each side a multiple of patch x merge, the area within its pixel bounds)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    size = image_processor.size  # a dict, or transformers' SizeDict
    lo, hi = (int(size[k] if isinstance(size, dict) else getattr(size, k)) for k in ("shortest_edge", "longest_edge"))
    factor = int(image_processor.patch_size) * int(image_processor.merge_size)
    h, w = smart_resize(height, width, factor=factor, min_pixels=lo, max_pixels=hi)
    return h // factor, w // factor


def mrope_positions(position_ids: torch.Tensor, spans: Sequence[ImageSpan]) -> torch.Tensor:
    """[3, B, n] positions of a micro-batch whose 1-D positions `position_ids` [B, n] are each token's position in
    its sample (packed rows restart per sample), for the images `spans` (every image of the micro-batch's samples
    that starts before the rank's slice ends, its pixels pulled or not). A column belongs to an image's sample where
    its position is the column less the image's offset."""
    out = position_ids.unsqueeze(0).repeat(3, 1, 1)
    n = position_ids.shape[1]
    cols = torch.arange(n, device=position_ids.device)
    pads: list[tuple[ImageSpan, int]] = []
    shift: dict[tuple[int, int], int] = {}  # (row, offset) -> the sample's shift before the image at hand
    for s in sorted(spans, key=lambda s: (s.row, s.offset, s.start)):
        count = s.rows * s.cols
        if s.tokens != count + 2:
            raise ModelError(f"an image's span holds {s.tokens} tokens, not its {s.rows}x{s.cols} grid's {count} "
                             "image tokens and two markers")
        before = shift.get((s.row, s.offset), 0)
        pads.append((s, before))
        sample_pos = cols - s.offset
        after = (position_ids[s.row] == sample_pos) & (sample_pos >= s.start + 1 + count)  # the text after it
        out[:, s.row] += (after * s.shift).to(out.dtype)
        shift[(s.row, s.offset)] = before + s.shift
    for s, before in pads:
        first = s.offset + s.start + 1  # column of the image's first pad
        lo, hi = max(0, -first), min(s.rows * s.cols, n - first)
        if lo >= hi:  # none of its pads in this slice
            continue
        k = torch.arange(lo, hi, device=position_ids.device)
        base = s.start + 1 + before
        at = first + k
        out[0, s.row, at] = base
        out[1, s.row, at] = base + torch.div(k, s.cols, rounding_mode="floor")
        out[2, s.row, at] = base + k % s.cols
    return out


class MropeProcessor:
    """The tokenizer and image processor of a Qwen2-VL-family model, called as its processor is: `text` with one
    `<|vision_start|><|image_pad|><|vision_end|>` per image (what its chat template writes for an image part),
    each image's pad repeated once per merged patch of its grid."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.chat_template = getattr(tokenizer, "chat_template", None)
        ids = tokenizer.convert_tokens_to_ids
        self.start_id, self.pad_id, self.end_id = int(ids(START)), int(ids(PAD)), int(ids(END))
        if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in (self.start_id, self.pad_id, self.end_id):
            raise ModelError(f"the tokenizer has no {START}, {PAD} or {END} token")

    def save_pretrained(self, out: str | os.PathLike[str]) -> None:
        """Write the tokenizer (with its chat template) and the image processor to `out`, as `load_processor`
        reads them back."""
        self.tokenizer.save_pretrained(out)
        self.image_processor.save_pretrained(out)

    def __call__(self, *, text: str, images: Sequence[Any], add_special_tokens: bool = False,
                 return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        out = self.image_processor(list(images), return_tensors="pt") if images else {}
        grids = out["image_grid_thw"].tolist() if images else []
        pieces = text.split(PAD)
        if len(pieces) - 1 != len(grids):
            raise ModelError(f"the text holds {len(pieces) - 1} image placeholder(s) for {len(grids)} image(s)")
        merge = int(self.image_processor.merge_size) ** 2
        expanded = pieces[0] + "".join(PAD * (t * h * w // merge) + rest for (t, h, w), rest in zip(grids, pieces[1:]))
        ids = self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
        return {"input_ids": torch.tensor([ids], dtype=torch.long), **out}
