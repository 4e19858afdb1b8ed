"""The built-in engine's own forward pass for Llama-style decoders, with a preallocated KV cache (`static_kv`)
written in place.

Why it exists: on the small models rollout runs on CPU, a decode step's time goes to the Python
overhead of the Hugging Face module stack (~60 module calls, mask construction, cache bookkeeping,
`torch.cat` of the whole cache every step), not to FLOPs. An inference engine owns its model code,
as vLLM and SGLang do; this one is the same math in a few functional ops per layer.

It owns `FastDecoder`: the forward over the HF model's parameters and rotary module, with the q/k/v
and gate/up projections fused into one matmul each (Phi-3's own fused projections are used as they are);
the fused copies are rebuilt whenever a source parameter changed in place, e.g. by a weight load; log-probs
match the trainer's forward to ~1e-6; the copies cost ~2/3 of the layers' weight memory again, acceptable for
the small CPU models it serves. The departures from a Llama layer it runs are the data of `quirks.Quirks`
(q/k RMSNorm per head or over all heads, norms after attention/MLP, layers without rotary embeddings, the
config's activation, Granite's multipliers); `quirks.read_quirks` decides which models qualify
(`FastDecoder.supports`), and the engine falls back to the HF forward for the others (`decode_path`).
With `batch_invariant` every row's logits are bitwise the same whatever rows share its batch (the engine's
`batch_invariant`), through the fixed-shape ops of `invariant_ops`; sparse expert blocks are not covered.
A LoRA version is applied unmerged (`set_adapters`, from `adapters.LiveAdapters`): each projection adds its
adapter's B (A x), the adapters of q/k/v and of gate/up fused like their weights (`adapters.fuse_low_rank`), so
a new version replaces a few small tensors and the fused base copies are not rebuilt.
A sparse expert block (router `gate` + `experts`, Qwen3-MoE and Mixtral) runs through its own module forward
on the [B, n] tokens of the step, so the router hooks that record routing (`engines.routing`) see every fed
token as under the HF forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from earl_stream.workers.engines import invariant_ops
from earl_stream.workers.engines.adapters import LowRank, fuse_low_rank
from earl_stream.workers.engines.quirks import QKNorm, Quirks, is_dense_mlp, read_quirks
from earl_stream.workers.engines.static_kv import StaticKV

__all__ = ["FastDecoder", "StaticKV"]

Norm = Any  # an HF RMSNorm module (`weight` [dim], `variance_epsilon`), as `quirks` accepted it


@dataclass
class _Layer:
    """One decoder layer's tensors, fused where that saves matmul calls ([out, in] weights). A norm is None
    where the layer has none at that place (pre-norm layers: before attention and MLP; OLMo 2: after)."""

    pre_attn: Norm | None
    post_attn: Norm | None
    pre_mlp: Norm | None
    post_mlp: Norm | None
    qkv_w: torch.Tensor  # [(H + 2 * Hkv) * D, hidden]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor | None  # [2 * intermediate, hidden]; None for a sparse expert block
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor | None
    down_b: torch.Tensor | None
    scaling: float
    rope: bool  # q and k rotated (SmolLM3 has layers without)
    act: Any = None  # the MLP's activation module (the config's `hidden_act`)
    experts: Any = None  # the layer's sparse expert block (its forward: [B, n, hidden] -> [B, n, hidden])
    q_norm: Norm | None = None  # quirks.QKNorm: per head over head_dim, or over the whole projection
    k_norm: Norm | None = None


@dataclass(frozen=True)
class _LayerAdapters:
    """One layer's LoRA updates, fused as its projections are (None: that projection has no adapter)."""

    qkv: LowRank | None = None
    o: LowRank | None = None
    gate_up: LowRank | None = None
    down: LowRank | None = None


def _apply(x: torch.Tensor, norm: Norm | None) -> torch.Tensor:
    """RMSNorm in one fused op for float32; in half precision the module itself, whose order of casts and
    weight product differs between families (OLMo 2 multiplies in float32, Llama after the cast)."""
    if norm is None:
        return x
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, float(norm.variance_epsilon))
    return norm(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastDecoder:
    """Forward of a supported HF causal LM over its live parameters; see the module docstring."""

    def __init__(self, model: PreTrainedModel, quirks: Quirks | None = None) -> None:
        """`quirks`: `quirks.read_quirks(model)` if already read. Raises ValueError for a model it cannot run."""
        if quirks is None:
            read = read_quirks(model)
            if not isinstance(read, Quirks):
                raise ValueError(f"{type(model).__name__} is not supported by FastDecoder: {'; '.join(read)}")
            quirks = read
        config = model.config
        inner = model.model
        self.quirks = quirks
        self._embed = inner.embed_tokens
        self._layers = list(inner.layers)
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._head = model.get_output_embeddings()
        self.num_layers = len(self._layers)
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        attn = self._layers[0].self_attn
        self.head_dim = int(getattr(attn, "head_dim", None) or config.hidden_size // self.num_heads)
        self.vocab_size = int(self._embed.weight.shape[0])
        self.dtype = self._embed.weight.dtype
        self.device = self._embed.weight.device
        self._fused: list[_Layer] = []
        self._fused_key: tuple[int, ...] = ()
        self._adapters = [_LayerAdapters()] * self.num_layers
        self._head_adapter: LowRank | None = None
        self.batch_invariant = False  # see the module docstring; the engine sets it
        self.refresh()

    def set_adapters(self, of: Callable[[torch.nn.Module], LowRank | None]) -> None:
        """Run with the LoRA updates `of` gives for each linear module (None: none); the base weights and their
        fused copies are left as they are."""

        def fused(lins: tuple[Any, ...]) -> LowRank | None:
            return fuse_low_rank([(of(lin), int(lin.weight.shape[0])) for lin in lins])

        out = []
        for layer in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = (attn.qkv_proj,) if hasattr(attn, "qkv_proj") else (attn.q_proj, attn.k_proj, attn.v_proj)
            if not is_dense_mlp(mlp):  # a mixture of experts runs its own module (adapters: its linears' hooks)
                out.append(_LayerAdapters(qkv=fused(qkv), o=of(attn.o_proj)))
                continue
            gate_up = (mlp.gate_up_proj,) if hasattr(mlp, "gate_up_proj") else (mlp.gate_proj, mlp.up_proj)
            out.append(_LayerAdapters(qkv=fused(qkv), o=of(attn.o_proj), gate_up=fused(gate_up), down=of(mlp.down_proj)))
        self._adapters = out
        self._head_adapter = of(self._head)

    def _sources(self) -> list[torch.Tensor]:
        out = []
        for layer in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            names = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj")
            for lin in (getattr(attn, n, None) or getattr(mlp, n, None) for n in names):
                if lin is None:
                    continue
                out.append(lin.weight)
                if lin.bias is not None:
                    out.append(lin.bias)
        return out

    def refresh(self) -> None:
        """Rebuild the fused projections if any source parameter was replaced or changed in place."""
        sources = self._sources()
        key = tuple(t._version for t in sources) + tuple(t.data_ptr() for t in sources)
        if key == self._fused_key:
            return
        with torch.no_grad():
            self._fused = [self._fuse(layer, self.quirks.rope_layers[i]) for i, layer in enumerate(self._layers)]
        self._fused_key = key

    @staticmethod
    def _fuse(layer: Any, rope: bool) -> _Layer:
        """`layer`: a Hugging Face decoder layer (its submodules are dynamic attributes, hence Any)."""
        attn, mlp = layer.self_attn, layer.mlp

        def fused(lins: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
            if len(lins) == 1:  # already fused by the model (Phi-3): used as it is
                return lins[0].weight, lins[0].bias
            if all(lin.bias is None for lin in lins):
                return torch.cat([lin.weight for lin in lins]), None
            return torch.cat([lin.weight for lin in lins]), torch.cat(
                [lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0]) for lin in lins])

        qkv_w, qkv_b = fused((attn.qkv_proj,) if hasattr(attn, "qkv_proj") else (attn.q_proj, attn.k_proj, attn.v_proj))
        dense = is_dense_mlp(mlp)
        gate_up_w, gate_up_b = (fused((mlp.gate_up_proj,) if hasattr(mlp, "gate_up_proj") else (mlp.gate_proj, mlp.up_proj))
                                if dense else (None, None))
        post = not hasattr(layer, "input_layernorm")  # OLMo 2: norms after attention and MLP
        return _Layer(
            pre_attn=None if post else layer.input_layernorm, post_attn=layer.post_attention_layernorm
            if post else None, pre_mlp=None if post else layer.post_attention_layernorm,
            post_mlp=layer.post_feedforward_layernorm if post else None,
            qkv_w=qkv_w, qkv_b=qkv_b, o_w=attn.o_proj.weight, o_b=attn.o_proj.bias,
            gate_up_w=gate_up_w, gate_up_b=gate_up_b,
            down_w=mlp.down_proj.weight if dense else None, down_b=mlp.down_proj.bias if dense else None,
            scaling=float(attn.scaling), rope=rope,
            act=(getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)) if dense else None,
            experts=None if dense else mlp,
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
        )

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        """True when every quirk of the model is one the fast decoder runs (`quirks.read_quirks`)."""
        return isinstance(read_quirks(model), Quirks)

    def new_cache(self, batch: int, capacity: int) -> StaticKV:
        """An empty cache for a new batch (and the moment to pick up changed weights)."""
        self.refresh()
        return StaticKV(self.num_layers, batch, self.kv_heads, capacity, self.head_dim, self.dtype, self.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache: StaticKV,
                *, last_only: bool = True) -> torch.Tensor:
        """Run ids [B, n] int64 at positions [B, n] int64 after the cache's `length` tokens.

        key_mask [B, length + n] (nonzero = a real token) masks padding keys; queries attend causally.
        Appends the new K/V to `cache`. Returns logits [B, V] of the last position (`last_only`) or
        [B, n, V], in the model dtype.
        """
        n = ids.shape[1]
        start = cache.length
        cache.reserve(n)
        q = self.quirks
        x = F.embedding(ids, self._embed.weight)
        if q.embedding_multiplier != 1.0:
            x = x * q.embedding_multiplier
        cos, sin = self._rotary(x, positions)
        rotary = (cos.unsqueeze(1), sin.unsqueeze(1))
        mask = self._attention_mask(key_mask, start, n)
        for i, (lay, ad) in enumerate(zip(self._fused, self._adapters)):
            o = self._attention(_apply(x, lay.pre_attn), lay, ad, cache.layers[i], rotary, key_mask, mask, start)
            x = self._residual(x, _apply(o, lay.post_attn))
            h = _apply(x, lay.pre_mlp)
            if lay.experts is not None:
                h = lay.experts(h)
            else:
                assert lay.gate_up_w is not None and lay.down_w is not None
                gate, up = self._linear(h, lay.gate_up_w, lay.gate_up_b, ad.gate_up).chunk(2, dim=-1)
                h = self._linear(lay.act(gate) * up, lay.down_w, lay.down_b, ad.down)
            x = self._residual(x, _apply(h, lay.post_mlp))
        cache.length = start + n
        if last_only:
            x = x[:, -1]
        x = _apply(x, self._norm)
        logits = self._linear(x, self._head.weight, getattr(self._head, "bias", None), self._head_adapter)
        return logits / q.logits_scaling if q.logits_scaling != 1.0 else logits

    def _residual(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        m = self.quirks.residual_multiplier
        return x + out * m if m != 1.0 else x + out

    def _attention(self, h: torch.Tensor, lay: _Layer, ad: _LayerAdapters, kv: Any,
                   rotary: tuple[torch.Tensor, torch.Tensor], key_mask: torch.Tensor, mask: torch.Tensor,
                   start: int) -> torch.Tensor:
        """Self-attention of h [B, n, hidden] over the cache layer `kv` (appending the new K/V) -> [B, n, hidden]."""
        b, n, _ = h.shape
        end = start + n
        heads, kv_heads, d = self.num_heads, self.kv_heads, self.head_dim
        qkv = self._linear(h, lay.qkv_w, lay.qkv_b, ad.qkv)
        if self.quirks.qk_norm is QKNorm.FULL and lay.q_norm is not None and lay.k_norm is not None:
            qkv = torch.cat([_apply(qkv[..., : heads * d], lay.q_norm),
                             _apply(qkv[..., heads * d : (heads + kv_heads) * d], lay.k_norm),
                             qkv[..., (heads + kv_heads) * d :]], dim=-1)
        qkv = qkv.view(b, n, heads + 2 * kv_heads, d).transpose(1, 2)
        qk = qkv[:, : heads + kv_heads]
        if self.quirks.qk_norm is QKNorm.HEAD and lay.q_norm is not None and lay.k_norm is not None:
            qk = torch.cat([_apply(qk[:, :heads], lay.q_norm), _apply(qk[:, heads:], lay.k_norm)], dim=1)
        if lay.rope:
            cos, sin = rotary
            # q and k rotated in one go, in cos's dtype (OLMo 2's rotary keeps float32), as HF does
            qk = (qk * cos + _rotate_half(qk) * sin).to(qkv.dtype)
        kv.k_buf[:, :, start:end] = qk[:, heads:]
        kv.v_buf[:, :, start:end] = qkv[:, heads + kv_heads :]
        keys, values = kv.k_buf[:, :, :end], kv.v_buf[:, :, :end]
        if self.batch_invariant and n == 1:
            o = invariant_ops.attend_decode(qk[:, :heads], keys, values, key_mask, kv_heads, lay.scaling)
        elif self.batch_invariant:
            o = invariant_ops.attend_prefill(qk[:, :heads], keys, values, key_mask, start, kv_heads, lay.scaling)
        else:
            o = self._attend(qk[:, :heads], keys, values, mask, lay.scaling)
        return self._linear(o.transpose(1, 2).reshape(b, n, heads * d), lay.o_w, lay.o_b, ad.o)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scaling: float) -> torch.Tensor:
        """q [B, H, n, D] over keys/values [B, Hkv, L, D] -> [B, H, n, D]; query head h reads kv head h // (H/Hkv).

        A decode step (n == 1) is written out: on CPU that beats SDPA's masked path for one query row.
        """
        b, heads, n, d = q.shape
        if n != 1:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling,
                                                  enable_gqa=self.kv_heads != heads)
        grouped = q.reshape(b, self.kv_heads, heads // self.kv_heads, d)
        scores = (grouped @ keys.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ values).reshape(b, heads, 1, d)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                adapter: LowRank | None = None) -> torch.Tensor:
        """x W^T + bias, plus the LoRA update B (A x) when the projection has an adapter (unmerged)."""
        linear = invariant_ops.linear_blocks if self.batch_invariant else F.linear
        out = linear(x, weight, bias)
        return out if adapter is None else out + adapter.update(x, linear)

    @staticmethod
    def _attention_mask(key_mask: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """Boolean [B, 1, n, start + n]: real keys at or before the query. A query always sees itself, so
        padding queries (whose outputs are never used) do not produce NaNs that would leak through V."""
        keys = key_mask[:, None, None, : start + n].bool()
        if n == 1:
            return keys
        cols = torch.arange(start + n, device=key_mask.device)
        rows = torch.arange(start, start + n, device=key_mask.device)[:, None]
        return (keys & (cols <= rows)) | (cols == rows)
