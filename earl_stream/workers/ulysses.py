"""Ulysses-style sequence parallelism for Hugging Face attention (Jacobs et al. 2023, DeepSpeed-Ulysses).

Owns the attention implementation "ulysses" (`ulysses_attention`, registered with transformers'
`AttentionInterface`) and which sp group it runs over (`set_sequence_parallel`, `sp_state`). Each
rank of an sp group holds a contiguous 1/sp slice of every sequence outside attention; inside
attention an all-to-all over heads gives each rank H/sp heads of the whole sequence, and a second
all-to-all gives the tokens back. Under tensor parallelism the heads a rank holds are already its
tp share, so the two compose (heads % (tp x sp) == 0). Which tokens a rank holds is
`workers.batches`' answer; which groups exist is `workers.mesh`'s.

Right padding never leaks into real tokens under a causal mask, so the padding mask is ignored.
On a packed micro-batch (`workers.packed_attention.packed_segments` in force) each rank holds a
contiguous 1/sp slice of the packed sequence, and after the all-to-all the attention runs per row
segment with the micro-batch's global boundaries, which every rank of the group knows from the claim.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from earl_stream.errors import ConfigError
from earl_stream.workers.packed_attention import attention_options, base_implementation, causal_mask, packed_bounds, segment_attention

ULYSSES = "ulysses"

@dataclasses.dataclass
class _SpState:
    group: Any = None  # the torch ProcessGroup of this rank's sp group; None when sp == 1
    size: int = 1
    rank: int = 0


_STATE = _SpState()


def set_sequence_parallel(models: Iterable[PreTrainedModel], group: Any, size: int, rank: int) -> None:
    """Route the models' attention through Ulysses over `group` (size > 1), or back to their own
    attention (size 1). Stays in force for forward and backward (recomputation re-runs attention)."""
    _STATE.group, _STATE.size, _STATE.rank = (group, size, rank) if size > 1 else (None, 1, 0)
    for model in models:
        # _attn_implementation is set on the instance; a vision-language model's text config only (its vision
        # tower attends within each image, whole on every rank)
        config: Any = model.config.get_text_config()
        base = base_implementation(config)
        if size > 1:
            heads = config.num_attention_heads
            if heads % size:
                raise ConfigError(f"sequence-parallel size {size} must divide the model's {heads} attention heads")
            config._attn_implementation = ULYSSES
        else:
            config._attn_implementation = base


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 ([sp, ...]: chunk i goes to rank i); its own adjoint."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # empty_like would copy a permuted view's strides, which the collective ignores
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _heads_to_sequence(x: torch.Tensor, p: int, group: Any) -> torch.Tensor:
    """[b, heads, n, d] (all heads, my tokens) -> [b, heads/p, p*n, d] (my heads, all tokens)."""
    b, h, n, d = x.shape
    chunks = x.reshape(b, p, h // p, n, d).permute(1, 0, 2, 3, 4)  # [p (head group), b, h/p, n, d]
    got = _AllToAll.apply(chunks, group)  # [p (token slice of rank j), b, h/p, n, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * n, d)


def _sequence_to_heads(x: torch.Tensor, p: int, group: Any) -> torch.Tensor:
    """[b, p*n, heads/p, d] (my heads, all tokens) -> [b, n, heads, d] (all heads, my tokens)."""
    b, s, hp, d = x.shape
    n = s // p
    chunks = x.reshape(b, p, n, hp, d).permute(1, 0, 2, 3, 4)  # [p (token slice), b, n, h/p, d]
    got = _AllToAll.apply(chunks, group)  # [p (head group j), b, n, h/p, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, n, p * hp, d)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face attention interface: q [b, H, n, d], k/v [b, KV, n, d] of this rank's n tokens
    (rotary embedding already applied with global positions) -> ([b, n, H, d], None).

    Causal over the whole sequence, or within each row of a packed one (and within a sliding-window
    layer's `sliding_window` positions back, global positions); `attention_mask` is ignored
    (right padding only, see the module docstring). kv heads are all-to-all'ed at their own width when
    sp divides them, else repeated to H first. The core runs the model's own implementation (eager
    materialises the scores; per row when packed).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    p, group = _STATE.size, _STATE.group
    if p == 1 or group is None:
        raise RuntimeError("ulysses attention is active without a sequence-parallel group (set_sequence_parallel)")
    groups = getattr(module, "num_key_value_groups", 1)
    if key.shape[1] % p:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        groups = 1
    q, k, v = (_heads_to_sequence(t, p, group) for t in (query, key, value))
    shim = types.SimpleNamespace(num_key_value_groups=groups, training=module.training, is_causal=True,
                                 layer_idx=getattr(module, "layer_idx", 0))
    base = base_implementation(module.config)
    s = q.shape[2]
    bounds = packed_bounds()
    window = attention_options(kwargs)
    if bounds is not None:
        out = segment_attention(shim, q, k, v, bounds, base=base, dropout=dropout, scaling=scaling,
                                sliding_window=window)
    elif base == "eager" or window is not None:
        mask = causal_mask(s, window, q.dtype, q.device)
        core: Any = eager_attention_forward if base == "eager" else sdpa_attention_forward
        out, _ = core(shim, q, k, v, mask, dropout=dropout, scaling=scaling)
    else:
        out, _ = sdpa_attention_forward(shim, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)  # type: ignore[arg-type]
    return _sequence_to_heads(out, p, group), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES, ulysses_attention)


_register()


def sp_state() -> tuple[int, int]:
    """(sp size, rank within the sp group) currently in force on this process."""
    return _STATE.size, _STATE.rank
