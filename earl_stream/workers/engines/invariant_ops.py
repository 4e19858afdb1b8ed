"""Batch-invariant forward ops of the built-in engine (`rollout.batch_invariant`): a row's result is bitwise
the same whichever rows share its batch, in whatever order, padded to whatever width.

Why they are needed: a BLAS picks its kernel, and with it the order of a float sum, by the shape of the call.
On this CPU's MKL a matmul of 1-3 rows (5 and 7 rows with 2 threads) sums in another order than one of 8 or
more, and an attention reduction over a batch's padded key length groups a row's real keys into other SIMD
lanes as the padding changes. A logit that moves by 1e-6 flips a rare sampled token, so a seeded episode would
depend on which episodes it happened to batch with, i.e. on timing.

It owns three ops, each computing a row only from that row, in fixed shapes:
- `linear_blocks`: F.linear on blocks of exactly `BLOCK_ROWS` rows (zero-padded);
- `attend_decode`: one query per row over that row's real keys, compacted to the front and cut into blocks
  of `KEY_BLOCK` keys; each block's max, sum and weighted values are fixed-shape reductions, and the blocks
  are combined one after the other (online softmax), where a row's empty trailing blocks add exactly zero;
- `attend_prefill`: the new tokens of one row at a time over exactly its real keys (prefills are rare).
A row's position within a fixed-shape call was checked not to change its result (1 and 2 threads).
It leaves the model's layers and the KV cache to `fast_decoder`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_ROWS = 8
KEY_BLOCK = 64


def linear_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear over x [..., in] on blocks of exactly BLOCK_ROWS rows of the flattened input."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if pad := -rows % BLOCK_ROWS:
        flat = torch.cat([flat, flat.new_zeros((pad, flat.shape[1]))])
    out = torch.cat([F.linear(block, weight, bias) for block in flat.split(BLOCK_ROWS)])
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def attend_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor,
                  kv_heads: int, scaling: float) -> torch.Tensor:
    """q [B, H, 1, D] over keys/values [B, Hkv, L, D] where key_mask [B, L] is nonzero -> [B, H, 1, D]."""
    b, heads, _, d = q.shape
    group = heads // kv_heads
    real = key_mask[:, : keys.shape[2]] != 0
    counts = real.sum(-1)
    width = max(KEY_BLOCK, -(-int(counts.max()) // KEY_BLOCK) * KEY_BLOCK)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real positions first, in order
    if order.shape[1] < width:
        order = torch.cat([order, order.new_zeros((b, width - order.shape[1]))], dim=1)
    order = order[:, :width]
    valid = torch.arange(width, device=q.device)[None, :] < counts[:, None]  # [B, W]
    index = order[:, None, :, None].expand(b, kv_heads, width, d)
    blocks = width // KEY_BLOCK
    k = keys.gather(2, index).view(b, kv_heads, blocks, KEY_BLOCK, d)
    v = values.gather(2, index).view(b, kv_heads, blocks, KEY_BLOCK, d)
    grouped = q.reshape(b, kv_heads, 1, group, d).expand(b, kv_heads, blocks, group, d)
    scores = (grouped @ k.transpose(-1, -2)) * scaling  # [B, Hkv, nb, g, KB]
    scores = scores.masked_fill(~valid.view(b, 1, blocks, 1, KEY_BLOCK), float("-inf"))
    block_max = scores.amax(-1, keepdim=True)  # -inf for a block past the row's keys
    safe_max = torch.where(torch.isfinite(block_max), block_max, torch.zeros_like(block_max))
    probs = torch.exp(scores - safe_max)  # exactly 0 where masked
    block_sum = probs.sum(-1, keepdim=True)
    block_out = probs @ v  # [B, Hkv, nb, g, D]
    run_max = torch.full_like(block_max[:, :, 0], float("-inf"))
    run_sum = torch.zeros_like(block_sum[:, :, 0])
    run_out = torch.zeros_like(block_out[:, :, 0])
    for j in range(blocks):  # online softmax, block by block: an empty block changes nothing
        new_max = torch.maximum(run_max, block_max[:, :, j])
        safe_new = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        keep = torch.exp(run_max - safe_new)
        add = torch.exp(block_max[:, :, j] - safe_new)
        run_sum = run_sum * keep + block_sum[:, :, j] * add
        run_out = run_out * keep + block_out[:, :, j] * add
        run_max = new_max
    return (run_out / run_sum).reshape(b, heads, 1, d)


def attend_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor, start: int,
                   kv_heads: int, scaling: float) -> torch.Tensor:
    """q [B, H, n, D] (new tokens left-padded) over keys/values [B, Hkv, L, D] (key_mask [B, L] nonzero = real),
    causally, one row at a time over exactly its real keys and queries -> [B, H, n, D] (padding queries: 0)."""
    b, heads, n, _ = q.shape
    out = torch.zeros_like(q)
    for i in range(b):
        real = key_mask[i, : keys.shape[2]].nonzero().squeeze(1)
        k, v = keys[i].index_select(1, real), values[i].index_select(1, real)  # [Hkv, Li, D], contiguous
        new = int(key_mask[i, start : start + n].sum())  # the row's real new tokens: the last `new` of the n
        if new == 0:
            continue
        past = k.shape[1] - new  # real keys before the first new token (kept KV)
        cols = torch.arange(k.shape[1], device=q.device)
        rows = torch.arange(past, past + new, device=q.device)[:, None]
        out[i, :, n - new :] = F.scaled_dot_product_attention(q[i, :, n - new :].contiguous(), k, v,
                                                              attn_mask=cols <= rows, scale=scaling,
                                                              enable_gqa=kv_heads != heads)
    return out
