"""The sample record: the one data contract for a finished episode crossing a process boundary.

A rollout worker builds one `SampleRecord` per finished episode. Its token-level fields share one
length T and are stored as contiguous shards in the producer's shard node; everything else is
metadata (a row of the Arrow layout index, see `earl_stream.store.schema`). The record owns its
arrays until `put` hands them to the shard node, which then owns them until the step that consumed
them is released.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from earl_stream.env.images import Image

# Token-level fields: name -> dtype. Every one has shape [T].
TOKEN_FIELDS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),  # 1 only on the model's own (generated) tokens
    "behaviour_logprobs": np.dtype(np.float32),  # log-prob of each token under the sampling policy; 0 where mask is 0
    "policy_version": np.dtype(np.int32),  # policy version that produced each token; -1 on non-model tokens
    "teacher_logprobs": np.dtype(np.float32),  # algo.distill's teacher log-prob of each token; 0 where mask is 0 or no teacher
}

# Routing replay (MoE models, `earl_stream.model.moe`): `SampleRecord.routed_experts` [T, L, k] holds, per
# token and MoE layer, the k experts the engine routed it to when it fed the token (uint8 when the model
# has < 255 experts, 255 = not recorded; else int16, -1 = not recorded); the engine never feeds an episode's
# last token, so its row is "not recorded". Stored flattened token-major as one field of T * L * k elements;
# the sample's metadata carries `info[ROUTED_EXPERTS]` = {"layers", "top_k", "dtype", "crc32"}
# (`routing_info`), which says its width per token and checks its bytes. Optional: dense models have none.
ROUTED_EXPERTS = "routed_experts"

# Images (vision-language policies): `SampleRecord.images` holds each image an episode showed, as
# PNG bytes and the span [start, start + tokens) of `input_ids` its image tokens take. Stored as one field of
# uint8 (the PNGs back to back); the metadata carries `info[IMAGES]` = {"spans": [[start, tokens, width, height,
# bytes], ...], "crc32"} (`images_info`). A consumer pulls whole images, those whose spans meet its token
# ranges (`image_byte_ranges`): a vision tower needs every patch of an image, so a sequence-parallel rank whose
# slice cuts an image pulls it whole and keeps the features of its own positions. Optional: text episodes have none.
IMAGES = "images"


@dataclasses.dataclass(frozen=True)
class SampleImage:
    """An image of an episode: positions [start, start + tokens) of its input_ids are the image's tokens (the
    processor's markers and image tokens), `image` its checked PNG bytes and size."""

    start: int
    tokens: int
    image: Image


@dataclasses.dataclass(frozen=True)
class SampleRecord:
    """One finished episode. Token fields are [T] numpy arrays of the dtypes in TOKEN_FIELDS."""

    sample_id: str
    prompt_ordinal: int  # monotonic ordinal of the prompt (seed) this episode was played from
    episode_id: str
    group_id: str  # episodes of the same prompt; advantages are normalised within a group
    env: str
    turns: int
    prompt_tokens: int  # tokens before the model's first generated token
    input_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    policy_version: np.ndarray
    reward: float
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    routed_experts: np.ndarray | None = None  # [T, L, k] uint8 or int16 (see ROUTED_EXPERTS above)
    # an episode whose agent rewrote its history (`rollout.non_append=split`) is several samples: this is
    # segment `segment` of `segments` (same episode_id, group and reward; its own prompt and loss mask)
    segment: int = 0
    segments: int = 1
    teacher_logprobs: np.ndarray | None = None  # None: zeros (no teacher scored the episode)
    images: tuple[SampleImage, ...] = ()  # the images it showed, in order of their spans (see IMAGES above)

    def __post_init__(self) -> None:
        if self.teacher_logprobs is None:
            object.__setattr__(self, "teacher_logprobs", np.zeros(self.input_ids.shape[0], np.float32))
        length = None
        for name, dtype in TOKEN_FIELDS.items():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1:
                raise ValueError(f"SampleRecord.{name} must be a 1-D numpy array, got {type(arr).__name__}")
            if arr.dtype != dtype:
                raise ValueError(f"SampleRecord.{name} must have dtype {dtype}, got {arr.dtype}")
            if length is None:
                length = arr.shape[0]
            elif arr.shape[0] != length:
                raise ValueError(f"SampleRecord.{name} has length {arr.shape[0]}, expected {length} like input_ids")
        _check_routing(self.routed_experts, length or 0)
        _check_images(self.images, length or 0)
        if not 0 <= self.prompt_tokens <= (length or 0):
            raise ValueError(f"prompt_tokens={self.prompt_tokens} outside [0, {length}]")
        if not 0 <= self.segment < self.segments:
            raise ValueError(f"segment={self.segment} outside [0, segments={self.segments})")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def token_fields(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in TOKEN_FIELDS}


def _check_routing(arr: np.ndarray | None, length: int) -> None:
    if arr is None:
        return
    if not isinstance(arr, np.ndarray) or arr.ndim != 3 or arr.shape[0] != length:
        raise ValueError(f"SampleRecord.routed_experts must be a [T={length}, layers, top_k] array, got "
                         f"{getattr(arr, 'shape', type(arr).__name__)}")
    if arr.dtype not in (np.dtype(np.uint8), np.dtype(np.int16)):
        raise ValueError(f"SampleRecord.routed_experts must be uint8 or int16, got {arr.dtype}")


def _check_images(images: tuple[SampleImage, ...], length: int) -> None:
    end = 0
    for k, img in enumerate(images):
        if not isinstance(img, SampleImage) or not isinstance(img.image, Image):
            raise ValueError(f"SampleRecord.images[{k}] must be a SampleImage of an Image, got {type(img).__name__}")
        if img.start < end or img.tokens < 1 or img.start + img.tokens > length:
            raise ValueError(f"SampleRecord.images[{k}] spans [{img.start}, {img.start + img.tokens}), which overlaps "
                             f"the previous image or leaves the {length} tokens")
        end = img.start + img.tokens


def images_info(info: dict[str, Any]) -> tuple[list[list[int]], int] | None:
    """(spans [[start, tokens, width, height, bytes], ...], crc32 of the PNGs back to back) of a sample's stored
    images, from its metadata's info; None when it has none."""
    d = info.get(IMAGES)
    if not isinstance(d, dict):
        return None
    return [[int(x) for x in span] for span in d["spans"]], int(d["crc32"])


def image_byte_ranges(spans: list[list[int]], token_ranges: list[tuple[int, int]] | None) -> list[tuple[int, int, int]]:
    """(image index, first byte, end byte) of each stored image whose span meets one of `token_ranges` (None:
    every image), in order."""
    out, offset = [], 0
    for k, (start, tokens, _w, _h, nbytes) in enumerate(spans):
        if token_ranges is None or any(start < e and s < start + tokens for s, e in token_ranges):
            out.append((k, offset, offset + nbytes))
        offset += nbytes
    return out


def routing_info(info: dict[str, Any]) -> tuple[np.dtype, int, int] | None:
    """(dtype, elements per token, crc32) of a sample's stored `routed_experts`, from its metadata's info;
    None when the sample has none."""
    d = info.get(ROUTED_EXPERTS)
    if not isinstance(d, dict):
        return None
    return np.dtype(d["dtype"]), int(d["layers"]) * int(d["top_k"]), int(d["crc32"])


# A rollout worker keeps the readable transcripts of its last TRANSCRIPTS_KEPT episodes in its shard
# node, under transcript_key(sample_id), for `earl-stream episodes` to pull.
TRANSCRIPTS_KEPT = 512


def transcript_key(sample_id: str) -> str:
    return f"t/{sample_id}"
