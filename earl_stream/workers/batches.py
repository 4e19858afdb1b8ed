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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


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
