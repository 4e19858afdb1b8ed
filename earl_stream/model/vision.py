"""Token-in/token-out rendering of multi-turn chats with images, for vision-language models.

`VisionChat` is `ChatFormat` for a model with a processor: an observation's images become the processor's image
tokens inside the turn's token ids, each a `SampleImage` (its PNG and the span of positions its tokens take, what an
episode's record keeps), and `prompt_image` gives the engine its image processor's tensors (`PromptImage`). Like
`ChatFormat`, an episode's ids are the first turn, then per turn the model's sampled tokens and the next turn's
pieces; the images of every turn keep their positions, so the engine reuses the KV of earlier turns (their images
are encoded once) and the trainer's forward sees the same tokens and pixels. Sampling and the episode record are the
agent loop's.

Families: Idefics3 / SmolVLM (an image is `<fake_token_around_image><global-img>`, the `<image>` tokens,
`<fake_token_around_image>`: the span that a `PromptImage` covers, so that a kept KV never cuts an image), and
Qwen2-VL / Qwen2.5-VL through `model.mrope.MropeProcessor` (an image is `<|vision_start|>`, one `<|image_pad|>` per
merged patch, `<|vision_end|>`; its tensors are the patches and their grid, `image_grid_thw`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from earl_stream.env.images import Image, Observation, decode_image, split_observation
from earl_stream.errors import ModelError
from earl_stream.model.chat import ChatFormat
from earl_stream.model.mrope import MropeProcessor
from earl_stream.records import SampleImage
from earl_stream.workers.engines.base import PromptImage

__all__ = ["VisionChat"]

_PER_IMAGE = ("pixel_values", "pixel_attention_mask")  # Idefics3: [images, tiles, ...], one image's at [0]
_PATCHES = ("pixel_values", "image_grid_thw")  # Qwen2-VL: [patches, ...] and [images, 3], one image's whole
_CACHE = 256  # pictures whose processor tensors are kept (a board game repeats its boards)


class VisionChat:
    """The token pieces (and image tensors) of a multi-turn chat with images under `processor`."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.chat = ChatFormat(self.tokenizer)
        self.end_token_id, self.stop_token_ids = self.chat.end_token_id, self.chat.stop_token_ids
        kind = type(processor).__name__
        self.mrope = isinstance(processor, MropeProcessor)
        if kind not in ("Idefics3Processor", "SmolVLMProcessor") and not self.mrope:
            raise ModelError(f"VisionChat renders Idefics3, SmolVLM and Qwen2-VL processors, not {kind}")
        ids = self.tokenizer.convert_tokens_to_ids
        self.image_token_id = processor.pad_id if self.mrope else int(ids("<image>"))
        self._around = processor.start_id if self.mrope else int(ids("<fake_token_around_image>"))
        self._global = processor.end_id if self.mrope else int(ids("<global-img>"))
        self._inputs: dict[bytes, dict[str, Any]] = {}

    @staticmethod
    def _content(text: str, images: Sequence[Image]) -> str | list[dict[str, Any]]:
        if not images:
            return text
        return [*({"type": "image"} for _ in images), {"type": "text", "text": text}]

    def first_turn(self, system: str | None, observation: str | Observation) -> tuple[list[int], list[SampleImage]]:
        """Token ids of [system?, user(observation)] and the assistant header, and the observation's images (their
        positions in those ids)."""
        text, images = split_observation(observation)
        return self._encode(self.chat.first_turn_text(system, self._content(text, images)), images)

    def next_turn(self, observation: str | Observation) -> tuple[list[int], list[SampleImage]]:
        """Token ids that follow the model's end-of-turn token (the user turn and the next assistant header) and
        the observation's images, their positions counted from the start of these ids."""
        text, images = split_observation(observation)
        return self._encode(self.chat.next_turn_text(self._content(text, images)), images)

    def reply_text(self, reply_ids: list[int]) -> str:
        return self.chat.reply_text(reply_ids)

    def prompt_image(self, image: SampleImage) -> PromptImage:
        """What the engine needs of an image: its span and its image processor's tensors (computed once per
        picture: kept for the last `_CACHE` pictures)."""
        key = hashlib.sha256(image.image.png).digest()
        inputs = self._inputs.get(key)
        if inputs is None:
            out = self.processor.image_processor([decode_image(image.image)], return_tensors="pt")
            if self.mrope:
                inputs = {name: out[name] for name in _PATCHES}
            else:
                inputs = {name: out[name][0] for name in _PER_IMAGE if name in out}  # every tile of the image
            self._inputs[key] = inputs
            if len(self._inputs) > _CACHE:
                self._inputs.pop(next(iter(self._inputs)))
        return PromptImage(image.start, image.tokens, inputs, key, image.image)

    def _encode(self, text: str, images: Sequence[Image]) -> tuple[list[int], list[SampleImage]]:
        if not images:
            return list(self.tokenizer.encode(text, add_special_tokens=False)), []
        out = self.processor(text=text, images=[decode_image(i) for i in images], add_special_tokens=False,
                             return_tensors="pt")
        ids = [int(t) for t in out["input_ids"][0]]
        spans = self._spans(ids)
        if len(spans) != len(images):
            raise ModelError(f"the processor laid out {len(spans)} image(s) for {len(images)}")
        return ids, [SampleImage(start, end - start, image) for (start, end), image in zip(spans, images)]

    def _spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each image's block: Qwen2-VL, `<|vision_start|>` to `<|vision_end|>`; Idefics3, its
        tiles' `<image>` runs (with image splitting, one run per tile, each after `<fake_token_around_image>` and a
        `<row_i_col_j>` tag) up to the run after `<global-img>`, and the markers around them."""
        if self.mrope:
            return self._marked_spans(ids)
        spans: list[tuple[int, int]] = []
        start, i = -1, 0
        while i < len(ids):
            if ids[i] != self.image_token_id:
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] == self.image_token_id:
                j += 1
            if start < 0:  # the block opens at the marker before this run's tag
                opening = max((k for k in range(max(0, i - 8), i) if ids[k] == self._around), default=i)
                start = opening
            if i > 0 and ids[i - 1] == self._global:  # the global image closes the block
                spans.append((start, j + 1 if j < len(ids) and ids[j] == self._around else j))
                start = -1
            i = j
        if start >= 0:
            raise ModelError("an image's tokens end without its global image")
        return spans

    def _marked_spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """Qwen2-VL's blocks: an opening marker, its image tokens only, the closing marker."""
        spans: list[tuple[int, int]] = []
        for i, t in enumerate(ids):
            if t != self._around:
                continue
            j = i + 1
            while j < len(ids) and ids[j] == self.image_token_id:
                j += 1
            if j == i + 1 or j == len(ids) or ids[j] != self._global:
                raise ModelError("an image's tokens are not one run of image tokens between its two markers")
            spans.append((i, j + 1))
        return spans
