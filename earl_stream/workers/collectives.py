"""The small collectives a trainer pool's ranks meet in outside the training math: strings, bytes and
flags as CPU tensors (gloo, also in a pool that computes on CUDA), never pickles.

Each is collective: every rank of the default process group calls it at the same point, in the same
order. With one rank (no process group) each returns its own input. The gradients' and the
parameters' collectives are `workers/mesh.py`'s and `workers/sharding.py`'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_STR_BYTES = 256


def broadcast_str(text: str, world_size: int) -> str:
    """Rank 0's string (at most MAX_STR_BYTES bytes of UTF-8) to every rank."""
    if world_size == 1:
        return text
    buf = _str_tensor(text)
    dist.broadcast(buf, src=0)
    return bytes(buf.tolist()).rstrip(b"\0").decode()


def all_gather_str(text: str, world_size: int) -> list[str]:
    """Every rank's string (at most MAX_STR_BYTES bytes), in rank order."""
    if world_size == 1:
        return [text]
    buf = _str_tensor(text)
    out = [torch.zeros_like(buf) for _ in range(world_size)]
    dist.all_gather(out, buf)
    return [bytes(b.tolist()).rstrip(b"\0").decode() for b in out]


def all_gather_flags(flag: bool, world_size: int) -> list[bool]:
    """Every rank's flag, in rank order."""
    if world_size == 1:
        return [flag]
    out = [torch.zeros(1, dtype=torch.int32) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([int(flag)], dtype=torch.int32))
    return [bool(t.item()) for t in out]


def any_rank(flags: list[bool], world_size: int) -> list[bool]:
    """For each of `flags`, whether any rank has it set (one MAX all-reduce): every rank gets the same
    answer, so all of them take the same branch after it."""
    if world_size == 1:
        return list(flags)
    votes = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    return [bool(v) for v in votes.tolist()]


def max_over_ranks(value: int, world_size: int) -> int:
    """The largest of every rank's `value` (one MAX all-reduce)."""
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_bytes(data: bytes) -> bytes:
    """Rank 0's bytes to every rank (length first, then the bytes)."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    if int(size) == 0:
        return b""
    buf = torch.zeros(int(size), dtype=torch.uint8)
    if dist.get_rank() == 0 and data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return buf.numpy().tobytes()


def _str_tensor(text: str) -> torch.Tensor:
    data = text.encode()
    assert len(data) <= MAX_STR_BYTES, f"{text[:60]!r}...: {len(data)} bytes, more than a collective string holds"
    buf = torch.zeros(MAX_STR_BYTES, dtype=torch.uint8)
    buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return buf
