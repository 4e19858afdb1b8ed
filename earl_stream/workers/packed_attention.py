"""Attention over packed micro-batches: rows concatenated into one [1, S] sequence, attention that
never crosses a row.

Owns the attention implementation "earl_packed" (`packed_attention`, registered with transformers'
`AttentionInterface`), the row boundaries of the micro-batch being run (`packed_segments`, a module
state set around each micro-batch's forward and backward, so that recomputation in backward sees the
same rows), and the exact per-row causal core (`segment_attention`) that Ulysses runs too after its
all-to-all (`workers.ulysses`). Which tokens a rank holds and how rows are packed is
`workers.batches`' job.

The core runs, per row segment [c_i, c_{i+1}) of the packed sequence, exact causal attention: on
CUDA in half precision with `flash_attn`'s varlen kernel when it is importable (one call over all
rows), else the model's own implementation (sdpa or eager) on `buckets` of segments, rows
right-padded to a bucket's longest, a bucket's rows x length^2 never above the longest row's
length^2. Peak attention memory is then that of the micro-batch's longest row alone (n x n scores
per head in eager or in SDPA's math kernel), never S x S.

A sliding-window layer (Gemma 3's local layers, Mistral's or Qwen2's window when set) passes its
`sliding_window` to the attention call: within each row a query then sees only the `sliding_window`
positions up to itself (transformers' rule), in every core (a banded mask; the varlen kernel's
`window_size`). Soft-capped attention logits (Gemma 2) are refused
(`workers.tensor_parallel.family_problems`).

No mask is built: "earl_packed" is not registered with transformers' mask interface, so the model
passes `attention_mask=None` (its mask helpers return early for an implementation they do not know)
instead of materialising the S x S packed-sequence mask that its position-id detection would build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

PACKED = "earl_packed"
BASE_ATTR = "_earl_base_attn_implementation"  # the model's own implementation, kept on its config


@dataclasses.dataclass
class _PackState:
    bounds: tuple[int, ...] | None = None  # segment boundaries 0 = c_0 < ... < c_R = S of the packed sequence


_STATE = _PackState()


def base_implementation(config: Any) -> str:
    """The model's own attention implementation (recorded on its config the first time it is asked)."""
    if not hasattr(config, BASE_ATTR):
        setattr(config, BASE_ATTR, config._attn_implementation or "eager")
    return str(getattr(config, BASE_ATTR))


def strip_run_state(model: torch.nn.Module) -> None:
    """Drop what training recorded on the model's config (packed attention's note of the model's own
    attention implementation), so that a saved config.json holds only the model's fields."""
    hf: Any = model
    config: Any = hf.config.get_text_config()
    if hasattr(config, BASE_ATTR):
        config._attn_implementation = getattr(config, BASE_ATTR)
        delattr(config, BASE_ATTR)


def segment_bounds(lengths: Sequence[int], width: int) -> tuple[int, ...]:
    """Boundaries of rows of `lengths` packed from position 0, plus the alignment padding up to `width`
    as one more segment; empty rows are left out."""
    bounds = [0]
    for n in lengths:
        if n > 0:
            bounds.append(bounds[-1] + n)
    if width > bounds[-1]:
        bounds.append(width)
    return tuple(bounds)


def packed_bounds() -> tuple[int, ...] | None:
    """The segment boundaries in force (None outside a packed micro-batch)."""
    return _STATE.bounds


@contextlib.contextmanager
def packed_segments(models: Iterable[Any], bounds: Sequence[int] | None) -> Iterator[None]:
    """Run the models' attention per segment of `bounds` (None: leave them as they are) while inside.

    A model still on its own implementation is switched to "earl_packed" and back on exit; one on
    Ulysses keeps it (Ulysses reads the same boundaries). Keep the forward and the backward inside:
    recomputation re-runs attention during backward.
    """
    if bounds is None:
        yield
        return
    switched = []
    for model in models:
        config = getattr(model, "config", None)
        config = None if config is None else config.get_text_config()  # a vision tower attends within each image
        if config is not None and config._attn_implementation == base_implementation(config):
            config._attn_implementation = PACKED
            switched.append(config)
    previous, _STATE.bounds = _STATE.bounds, tuple(int(b) for b in bounds)
    try:
        yield
    finally:
        _STATE.bounds = previous
        for config in switched:
            config._attn_implementation = getattr(config, BASE_ATTR)


def _flash_varlen() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return flash_attn_varlen_func


def buckets(bounds: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The segments grouped for batched attention: longest first, each bucket's rows right-padded to its
    first (longest) row L. A row joins the bucket while it is at least 3/4 L long (at most a third
    of a bucket's positions are padding) and (rows + 1) x L^2 <= the longest row's length^2, so
    that no bucket's scores exceed those of the micro-batch's longest row alone."""
    segs = sorted(zip(bounds[:-1], bounds[1:]), key=lambda s: (s[0] - s[1], s[0]))
    cap = (segs[0][1] - segs[0][0]) ** 2 if segs else 0
    out: list[list[tuple[int, int]]] = []
    for a, b in segs:
        top = out[-1][0][1] - out[-1][0][0] if out else 0
        if out and 4 * (b - a) >= 3 * top and (len(out[-1]) + 1) * top ** 2 <= cap:
            out[-1].append((a, b))
        else:
            out.append([(a, b)])
    return out


def _rows(t: torch.Tensor, bucket: Sequence[tuple[int, int]], n: int) -> torch.Tensor:
    """[1, heads, S, d] -> [rows, heads, n, d]: the bucket's segments right-padded to n (a view for one)."""
    if len(bucket) == 1:
        return t[:, :, bucket[0][0]: bucket[0][1]]
    return torch.cat([F.pad(t[:, :, a:b], (0, 0, 0, n - (b - a))) for a, b in bucket])


def causal_mask(n: int, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, n, n] additive mask: query i sees keys j <= i, and with a sliding `window` only j > i - window
    (transformers' `sliding_window_overlay`)."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    allowed = (d >= 0) if window is None else (d >= 0) & (d < window)
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def attention_options(kwargs: dict[str, Any]) -> int | None:
    """The sliding window a layer's attention call asks for (None: full causal attention); RuntimeError
    for what the trainer's attention does not compute (soft-capped logits)."""
    if kwargs.get("softcap") is not None:
        raise RuntimeError("attention logit soft-capping is not supported by packed or Ulysses attention "
                           "(workers.tensor_parallel.family_problems refuses such a model)")
    window = kwargs.get("sliding_window")
    return int(window) if window else None


def segment_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      bounds: Sequence[int], *, base: str, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention within each segment [bounds[i], bounds[i+1]) of one packed sequence (and within
    `sliding_window` positions back, for a sliding-window layer).

    q [1, H, S, d], k/v [1, KV, S, d] (KV divides H; `module.num_key_value_groups` = H / KV) ->
    [1, S, H, d]. Off the varlen kernel the segments run in `buckets`, each a batch [rows, H, L, d]
    of rows right-padded to its longest L (exact: under a causal mask right padding reaches no real
    token) through `base` ("eager" builds an L x L causal mask; anything else runs SDPA with is_causal,
    or with that mask under a sliding window).
    """
    s = query.shape[2]
    if bounds[0] != 0 or bounds[-1] != s:
        raise RuntimeError(f"packed segments {bounds[0]}..{bounds[-1]} do not cover the {s} positions attention sees")
    varlen = _flash_varlen() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
    if varlen is not None:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, heads, d]
        cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        out = varlen(q, k, v, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scaling, causal=True,
                     window_size=window)
        return out.unsqueeze(0)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    pieces: dict[int, torch.Tensor] = {}
    for bucket in buckets(bounds):
        n = bucket[0][1] - bucket[0][0]

        q, k, v = (_rows(t, bucket, n) for t in (query, key, value))
        if base == "eager" or sliding_window is not None:
            mask = causal_mask(n, sliding_window, q.dtype, q.device)
            core = eager_attention_forward if base == "eager" else sdpa_attention_forward
            out, _ = core(module, q, k, v, mask, dropout=dropout, scaling=scaling)
        else:
            out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)
        for i, (a, b) in enumerate(bucket):  # out [rows, n, H, d]
            pieces[a] = out[i: i + 1, : b - a]
    return torch.cat([pieces[a] for a in bounds[:-1]], dim=1)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face attention interface: q [1, H, S, d], k/v [1, KV, S, d] of a packed micro-batch
    (rotary embedding applied with per-row positions) -> ([1, S, H, d], None). `attention_mask` is
    None (see the module docstring); the rows come from `packed_segments`; a sliding-window layer's
    `sliding_window` keyword is honoured within each row."""
    bounds = _STATE.bounds
    if bounds is None or query.shape[0] != 1:
        raise RuntimeError("packed attention runs one packed sequence inside packed_segments()")
    shim = types.SimpleNamespace(num_key_value_groups=getattr(module, "num_key_value_groups", 1),
                                 training=module.training, is_causal=True, layer_idx=getattr(module, "layer_idx", 0))
    base = getattr(getattr(module, "config", None), BASE_ATTR, "sdpa")
    return segment_attention(shim, query, key, value, bounds, base=base, dropout=dropout, scaling=scaling,
                             sliding_window=attention_options(kwargs)), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED, packed_attention)


_register()
