"""The C library's heap under a CPU rank: what glibc keeps after tensors are freed.

PyTorch's CPU allocator takes memory from malloc. glibc serves blocks under its mmap threshold from
heaps that it seldom returns to the OS, and by default it raises that threshold each time a mapped
block is freed, so in a long-lived rank whose tensor shapes change from step to step, resident memory
grows past the live tensors (and past the memory model, which counts live tensors only).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

__all__ = ["free_unused_memory", "set_malloc_mmap_threshold"]


@functools.cache  # find_library may run ldconfig: once per process
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def set_malloc_mmap_threshold(nbytes: int) -> bool:
    """glibc's `mallopt(M_MMAP_THRESHOLD, nbytes)`: from now on an allocation of at least `nbytes` is a mapping of
    its own, unmapped when freed (and glibc stops raising the threshold as it does by default after a mapped
    block is freed). False where the C library has no mallopt (musl, macOS) or refuses the value."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt(-3, nbytes)) if mallopt is not None else False  # -3: M_MMAP_THRESHOLD (malloc.h)


def free_unused_memory() -> None:
    """Call once the caller dropped the model and optimizer a re-shard replaced: a laid-out model is
    a web of reference cycles (module hooks, DTensor specs) that only the cyclic GC frees, and glibc
    keeps freed heap memory in its arenas, where it still counts against the rank's memory (and a
    real cap) during the next step."""
    gc.collect()
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:  # glibc; elsewhere there is nothing to trim
        trim(0)
