"""Recognising an allocation failure, for every worker that sheds load instead of dying on one.

Owns `is_allocation_failure` (CUDA `torch.OutOfMemoryError`, a CPU allocator `RuntimeError` such as
"DefaultCPUAllocator: can't allocate memory", and Python's `MemoryError`), `attempted_bytes` (the size
of the failed allocation when the message says it) and `release_cached` (frees what a failed step left
behind). What to do about the failure (re-queue, shrink a batch) is the caller's: the rollout engine's
`engines.shedding`, later the trainer.
"""

from __future__ import annotations

import re
import traceback

import torch

# Messages of allocators that raise a plain RuntimeError: c10's CPU allocator (Linux, Windows), HIP, MPS.
_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
             "CUDA out of memory", "HIP out of memory", "MPS backend out of memory")
_TRIED = re.compile(r"tried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNIT = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def is_allocation_failure(exc: BaseException) -> bool:
    """True when `exc` says an allocation failed (device or host memory), not a bug or a bad input."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MESSAGES)


def attempted_bytes(exc: BaseException) -> int | None:
    """The bytes the failed allocation asked for, when its message says (CPU: exact; CUDA: rounded)."""
    found = _TRIED.search(str(exc))
    if found is None:
        return None
    return int(float(found.group(1)) * _UNIT[found.group(2).lower()])


def release_cached(exc: BaseException, device: torch.device) -> None:
    """Free what the failed step allocated: the frames of `exc`'s traceback hold its temporaries (clear
    their locals), and on CUDA the caching allocator keeps freed blocks until `empty_cache`."""
    if exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
