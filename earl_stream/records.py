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

# Token-level fields: name -> dtype. Every one has shape [T].
TOKEN_FIELDS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),  # 1 only on the model's own (generated) tokens
    "behaviour_logprobs": np.dtype(np.float32),  # log-prob of each token under the sampling policy; 0 where mask is 0
    "policy_version": np.dtype(np.int32),  # policy version that produced each token; -1 on non-model tokens
    "teacher_logprobs": np.dtype(np.float32),  # algo.distill's teacher log-prob of each token; 0 where mask is 0 or no teacher
}


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
    teacher_logprobs: np.ndarray | None = None  # None: zeros (no teacher scored the episode)

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
        if not 0 <= self.prompt_tokens <= (length or 0):
            raise ValueError(f"prompt_tokens={self.prompt_tokens} outside [0, {length}]")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def token_fields(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in TOKEN_FIELDS}


# A rollout worker keeps the readable transcripts of its last TRANSCRIPTS_KEPT episodes in its shard
# node, under transcript_key(sample_id), for `earl-stream episodes` to pull.
TRANSCRIPTS_KEPT = 512


def transcript_key(sample_id: str) -> str:
    return f"t/{sample_id}"
