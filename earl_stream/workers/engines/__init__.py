"""Inference engines of the rollout workers: the `Engine` Protocol, the built-in torch backend, and the
asyncio batcher that shares one engine among many concurrent episodes.

`TorchEngine` (and its `DecodePath`/`PathChoice`) is imported lazily so that importing the Protocol does not import transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from earl_stream.workers.engines.base import Engine, EngineCapacity, FinishReason, GenerateRequest, GenerateResult, PromptImage
from earl_stream.workers.engines.batcher import AsyncBatcher

if TYPE_CHECKING:
    from earl_stream.workers.engines.decode_path import DecodePath, PathChoice
    from earl_stream.workers.engines.torch_engine import EngineStats, TorchEngine

__all__ = [
    "AsyncBatcher",
    "DecodePath",
    "Engine",
    "EngineCapacity",
    "EngineStats",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "PathChoice",
    "PromptImage",
    "TorchEngine",
]


def __getattr__(name: str) -> Any:
    if name in ("TorchEngine", "EngineStats"):
        from earl_stream.workers.engines import torch_engine

        return getattr(torch_engine, name)
    if name in ("DecodePath", "PathChoice"):
        from earl_stream.workers.engines import decode_path

        return getattr(decode_path, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
