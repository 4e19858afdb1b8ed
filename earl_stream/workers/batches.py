"""Building a rank's micro-batch tensors from the rows it pulled.

Owns the token alignment of a micro-batch under sequence parallelism and the store ranges it
implies. A micro-batch [B, T] is right-padded to W = ceil(T/sp)*sp; sp rank r runs positions
[a, b) = [r W/sp, (r+1) W/sp) with their true position ids, and its logits at position t score
token t+1, so its loss tensors are those of positions [a+1, b+1) (the last rank's last position
has no next token and a zero mask). With sp = 1 the one window is the whole micro-batch.

What the store serves an sp rank (`sp_windows`, `sp_token_ranges`, `local_batch`): every rank of an
sp group gets the same rows and micro-batches from `partition` (cp = sp), and pulls of each row only
[a, b + 1) (its slice plus the next token), so a step moves each token about once per sp group. The
slices are contiguous, not `partition`'s zig-zag `token_ranges` (those balance ring attention;
Ulysses computes attention over the whole sequence on every rank, so it needs no balancing).

Packed micro-batches (`trainer.packing`, `packed_windows`, `packed_token_ranges`,
`packed_local_batch`): the micro-batch's rows are concatenated in order into one sequence of L
tokens, right-padded to W = ceil(L/sp)*sp (alignment padding), with position ids restarting at 0 per
row; sp rank r runs packed positions [r W/sp, (r+1) W/sp). A position's label is the next token of
its own row: a row's last position has a zero mask, never the next row's first token. A rank pulls
of each row only the tokens inside its slice plus the next one of the same row. Both layouts hold
`store.layout.materialised_tokens` tokens per micro-batch over the sp group, the plan's budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from earl_stream.workers.packed_attention import segment_bounds


def shard_batch(batch: dict[str, torch.Tensor], sp: int, sp_rank: int) -> dict[str, torch.Tensor]:
    """This sp rank's part of a micro-batch from `train_step.batch_tensors` (all [B, T]).

    Returns input_ids/position_ids [B, n] of positions [a, b) (n = ceil(T/sp)), `labels` [B, n]
    (the token after each position), and loss_mask / behaviour_logprobs (and any other [B, T]
    float field) at positions [a+1, b+1), zero-padded; `advantages` [B] unchanged.
    """
    ids = batch["input_ids"]
    b, t = ids.shape
    n = -(-t // sp)
    start, end = sp_rank * n, (sp_rank + 1) * n

    def window(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        x = F.pad(x, (0, max(0, sp * n + 1 - t)))
        return x[:, lo:hi]

    out = {"input_ids": window(ids, start, end),
           "position_ids": torch.arange(start, end).unsqueeze(0).expand(b, n),
           "labels": window(ids, start + 1, end + 1)}
    for k, v in batch.items():
        if k in out or k in ("attention_mask",):
            continue
        out[k] = v if v.dim() == 1 else window(v, start + 1, end + 1)
    return out


def sp_windows(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int], sp: int,
               sp_rank: int) -> list[tuple[int, int]]:
    """(start a, tokens n) of this sp rank in each micro-batch: the micro-batch is padded to its longest
    row rounded up to a multiple of sp, and rank r runs positions [r n, (r + 1) n)."""
    out = []
    for mb in micro_batches:
        n = -(-max(lengths[i] for i in mb) // sp)
        out.append((sp_rank * n, n))
    return out


def sp_token_ranges(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int],
                    windows: Sequence[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
    """Row -> the [start, end) token range this sp rank pulls from the store: its positions [a, a+n)
    plus the next token (its last position's label), clipped to the row (possibly empty)."""
    ranges = {}
    for mb, (a, n) in zip(micro_batches, windows):
        for i in mb:
            ranges[i] = [(min(a, lengths[i]), min(a + n + 1, lengths[i]))]
    return ranges


def local_batch(rows: Sequence[dict[str, np.ndarray]], advantages: np.ndarray, window: tuple[int, int]) -> dict[str, torch.Tensor]:
    """This sp rank's part of a micro-batch from rows pulled with `sp_token_ranges` (each field holds
    the row's tokens [a, min(a + n + 1, length))): the same tensors as `shard_batch` of the whole
    micro-batch, without pulling or padding the other ranks' tokens."""
    a, n = window
    b = len(rows)
    ids = torch.zeros(b, n + 1, dtype=torch.long)
    mask = torch.zeros(b, n + 1, dtype=torch.float32)
    blp = torch.zeros(b, n + 1, dtype=torch.float32)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.from_numpy(r["input_ids"].astype(np.int64))
        mask[i, :k] = torch.from_numpy(r["loss_mask"].astype(np.float32))
        blp[i, :k] = torch.from_numpy(r["behaviour_logprobs"])
    return {"input_ids": ids[:, :n], "position_ids": torch.arange(a, a + n).unsqueeze(0).expand(b, n),
            "labels": ids[:, 1:], "loss_mask": mask[:, 1:], "behaviour_logprobs": blp[:, 1:],
            "advantages": torch.from_numpy(np.asarray(advantages, dtype=np.float32))}


def packed_windows(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int], sp: int,
                   sp_rank: int) -> list[tuple[int, int]]:
    """(start a, tokens n) of this sp rank in each packed micro-batch: its rows' total length rounded up
    to a multiple of sp, and rank r runs packed positions [r n, (r + 1) n)."""
    out = []
    for mb in micro_batches:
        n = -(-sum(lengths[i] for i in mb) // sp)
        out.append((sp_rank * n, n))
    return out


def packed_token_ranges(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int],
                        windows: Sequence[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
    """Row -> the [start, end) range of its tokens this sp rank pulls for a packed micro-batch: those
    inside its slice [a, a+n) plus the next token of the row (its last position's label); empty when
    the row has no token in the slice."""
    ranges = {}
    for mb, (a, n) in zip(micro_batches, windows):
        o = 0
        for i in mb:
            lo, hi = max(a, o), min(a + n, o + lengths[i])
            ranges[i] = [(lo - o, min(hi + 1, o + lengths[i]) - o)] if lo < hi else [(0, 0)]
            o += lengths[i]
    return ranges


def rank_windows(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int], sp: int, sp_rank: int, *,
                 packed: bool) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int]]] | None]:
    """This sp rank's window (a, n) in each micro-batch, packed or padded, and the token ranges it pulls
    of each row (None when sp == 1: whole rows)."""
    windows = (packed_windows if packed else sp_windows)(micro_batches, lengths, sp, sp_rank)
    if sp == 1:
        return windows, None
    return windows, (packed_token_ranges if packed else sp_token_ranges)(micro_batches, lengths, windows)


_INT_FIELDS = ("input_ids", "policy_version")


def packed_local_batch(rows: Sequence[Mapping[str, np.ndarray] | None], lengths: Sequence[int],
                       window: tuple[int, int], sp: int, fill: Mapping[str, float] | None = None) -> dict[str, Any]:
    """This sp rank's slice of a packed micro-batch whose rows have `lengths` (in packing order).

    `rows[j]`: row j's fields, whole or as pulled with `packed_token_ranges`; None for a row lost since
    the micro-batch was planned (its span stays in place as padding, so no rank's slice moves).
    Returns input_ids / position_ids (restarting at 0 per row) [1, n] of packed positions [a, a+n);
    labels, loss_mask, behaviour_logprobs and any further field (e.g. policy_version, `fill[field]`
    where there is no token) [1, n] of positions [a+1, a+n+1), zero where that position is in another
    row; `token_rows` [n] int64 (the row j whose next token position t scores, -1 where none); and
    `segments`, the packed sequence's row boundaries over its whole width (`segment_bounds`).
    """
    a, n = window
    fill = fill or {}
    keys = sorted({k for r in rows if r is not None for k in r} | {"input_ids", "loss_mask", "behaviour_logprobs"})
    buf = {k: np.full(n + 1, fill.get(k, 0), np.float64) for k in keys}
    row_of = np.full(n + 1, -1, np.int64)
    pos = np.arange(a, a + n + 1, dtype=np.int64) - sum(lengths)  # padding: positions past the rows
    o = 0
    for j, (r, length) in enumerate(zip(rows, lengths)):
        lo, hi = max(a, o), min(a + n + 1, o + length)
        if lo < hi:
            row_of[lo - a: hi - a] = j
            pos[lo - a: hi - a] = np.arange(lo - o, hi - o)
            for k, v in (r or {}).items():
                part = v[lo - o: hi - o] if len(v) == length else v  # a whole row, or the range pulled
                buf[k][lo - a: lo - a + len(part)] = part
        o += length
    same = (row_of[1:] == row_of[:-1]) & (row_of[:-1] >= 0)

    def shifted(k: str) -> torch.Tensor:
        x = torch.from_numpy(np.where(same, buf[k][1:], fill.get(k, 0)))
        return (x.long() if k in _INT_FIELDS else x.float())[None]

    out: dict[str, Any] = {k: shifted(k) for k in keys if k != "input_ids"}
    ids = torch.from_numpy(buf["input_ids"]).long()
    out.update(input_ids=ids[None, :n], position_ids=torch.from_numpy(pos[:n])[None], labels=shifted("input_ids"),
               token_rows=torch.from_numpy(np.where(same, row_of[:n], -1)), segments=segment_bounds(lengths, sp * n))
    return out


def agree_on_lost(metas: Sequence[Any], pulled: dict[int, Any], lost: list[str]) -> tuple[dict[int, Any], list[str]]:
    """Drop on every rank the rows any rank lost (one MAX all-reduce of a flag per claimed row).

    The ranks of an sp group run collectives per micro-batch, so they must run the same rows even
    when a producer died between their pulls.
    """
    index = {m.sample_id: i for i, m in enumerate(metas)}
    flags = torch.zeros(len(metas), dtype=torch.int32)
    for sid in lost:
        flags[index[sid]] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    gone = {i for i in range(len(metas)) if flags[i]}
    return {i: r for i, r in pulled.items() if i not in gone}, [metas[i].sample_id for i in sorted(gone)]


def batch_tensors(rows: Sequence[dict[str, np.ndarray]], advantages: np.ndarray) -> dict[str, torch.Tensor]:
    """Right-pad rows into [B, T] tensors: input_ids int64, attention/loss masks, behaviour log-probs."""
    width = max(len(r["input_ids"]) for r in rows)
    b = len(rows)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.float32)
    blp = torch.zeros(b, width, dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.from_numpy(r["input_ids"].astype(np.int64))
        attn[i, :n] = 1
        mask[i, :n] = torch.from_numpy(r["loss_mask"].astype(np.float32))
        blp[i, :n] = torch.from_numpy(r["behaviour_logprobs"])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "behaviour_logprobs": blp,
            "advantages": torch.from_numpy(np.asarray(advantages, dtype=np.float32))}



def dummy_batch(sp_rank: int) -> dict[str, torch.Tensor]:
    """A one-token micro-batch whose loss is zero (mask 0, advantage 0): a rank with no rows of its
    own in a pass runs it so that the collectives inside the pass (FSDP gathers, sp all-to-alls)
    still meet every rank of its groups."""
    row: dict[str, np.ndarray] = {"input_ids": np.zeros(2, np.int32), "loss_mask": np.zeros(2, np.uint8),
           "behaviour_logprobs": np.zeros(2, np.float32)}
    return local_batch([row], np.zeros(1, np.float32), (sp_rank, 1))
