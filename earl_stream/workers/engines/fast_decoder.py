"""The built-in engine's own forward pass for Llama-family decoders (Qwen2, Llama, Mistral, and the
mixtures of experts Qwen3-MoE and Mixtral), with a preallocated KV cache written in place.

Why it exists: on the small models rollout runs on CPU, a decode step's time goes to the Python
overhead of the Hugging Face module stack (~60 module calls, mask construction, cache bookkeeping,
`torch.cat` of the whole cache every step), not to FLOPs. An inference engine owns its model code,
as vLLM and SGLang do; this one is the same math in a few functional ops per layer.

It owns: `FastDecoder` (the forward over the HF model's parameters and rotary module, with the q/k/v
and gate/up projections fused into one matmul each; the fused copies are rebuilt whenever a source
parameter changed in place, e.g. by a weight load; log-probs match the trainer's forward to ~1e-6; the
copies cost ~2/3 of the layers' weight memory again, acceptable for the small CPU models it serves) and
`StaticKV` (per layer [B, kv_heads, capacity, head_dim] buffers shared by every row of a batch, with
the same `.layers[i].keys/.values/.batch_select_indices` surface the engine uses on a DynamicCache).
With `batch_invariant` every row's logits are bitwise the same whatever rows share its batch (the engine's
`batch_invariant`), through the fixed-shape ops of `invariant_ops`; sparse expert blocks are not covered.
It leaves everything else to the HF forward: `FastDecoder.supports(model)` says which models qualify
(full attention only, SiLU MLP or a sparse expert block, standard pre-norm layers). A sparse expert block
(router `gate` + `experts`) runs through its own module forward on the [B, n] tokens of the step, so the
router hooks that record routing (`engines.routing`) see every fed token as under the HF forward;
Qwen3-MoE's per-head q/k RMSNorm is applied before the rotary embedding as Hugging Face does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from earl_stream.workers.engines import invariant_ops

_FAMILIES = ("qwen2", "llama", "mistral", "qwen3_moe", "mixtral")
_QK_NORM = ("qwen3_moe",)  # families whose attention normalises q and k per head (q_norm, k_norm)


class _StaticLayer:
    """One layer's K/V storage [rows_capacity, kv_heads, capacity, head_dim]; `k_buf`/`v_buf` are the
    live rows' part [B, ...] and `keys`/`values` its filled positions [B, kv_heads, length, head_dim]."""

    def __init__(self, owner: StaticKV, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._owner = owner
        self.k_store = keys
        self.v_store = values

    @property
    def k_buf(self) -> torch.Tensor:
        return self.k_store[: self._owner.rows]

    @property
    def v_buf(self) -> torch.Tensor:
        return self.v_store[: self._owner.rows]

    @property
    def keys(self) -> torch.Tensor:
        return self.k_buf[:, :, : self._owner.length]

    @property
    def values(self) -> torch.Tensor:
        return self.v_buf[:, :, : self._owner.length]

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        """Keep the rows `idx` [B'] int64 (repeats allowed). Written in place while they fit the storage."""
        for name in ("k_store", "v_store"):
            store = getattr(self, name)
            picked = store[: self._owner.rows].index_select(0, idx)
            if idx.numel() <= store.shape[0]:
                store[: idx.numel()] = picked
            else:
                setattr(self, name, picked)


class StaticKV:
    """A batch's KV cache: all rows share one length (the batch is left-padded).

    The storage is preallocated and reused step after step: appending a token writes in place,
    dropping rows compacts them in place, admitting rows (`append_rows`) writes after the live ones;
    it grows (doubling) only when the positions or the rows outgrow it. Padding positions always
    hold finite values (zeros or stale KV), which the attention mask hides.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.length = 0
        self.rows = batch
        self.layers = [_StaticLayer(self, torch.zeros(shape, dtype=dtype, device=device),
                                    torch.zeros(shape, dtype=dtype, device=device)) for _ in range(layers)]

    @property
    def capacity(self) -> int:
        return self.layers[0].k_store.shape[2]

    @property
    def row_capacity(self) -> int:
        return self.layers[0].k_store.shape[0]

    @property
    def held_tokens(self) -> int:
        """Token positions of the storage (rows x positions): what this cache holds in memory."""
        return self.row_capacity * self.capacity

    def reserve(self, tokens: int, rows: int = 0, *, exact: bool = False) -> None:
        """Make room for `tokens` more positions and `rows` more rows. Positions grow by doubling (appends
        stay amortised O(1)) and rows exactly; with `exact` (the caller knows the final size: a join) a
        storage that must grow is re-allocated to exactly the live rows + `rows` x length + `tokens`,
        dropping rows and positions no longer used (the engine's admission counts that size). One layer
        is re-allocated at a time: old and new storage coexist for that layer only."""
        need_len, need_rows = self.length + tokens, self.rows + rows
        if need_len <= self.capacity and need_rows <= self.row_capacity:
            return
        if exact:
            self._reallocate(need_rows, need_len)
            return
        new_cap = self.capacity if need_len <= self.capacity else max(need_len, 2 * self.capacity)
        self._reallocate(max(need_rows, self.row_capacity), new_cap)

    def compact(self, room: int) -> None:
        """Shrink the storage to exactly the live rows x (length + `room`) positions, freeing what rows
        that left and positions no row will use held (one layer at a time, as `reserve`)."""
        if self.rows * (self.length + room) < self.held_tokens:
            self._reallocate(self.rows, self.length + room)

    def _reallocate(self, new_rows: int, new_cap: int) -> None:
        for layer in self.layers:
            for name in ("k_store", "v_store"):
                old = getattr(layer, name)
                grown = old.new_zeros((new_rows, old.shape[1], new_cap, old.shape[3]))
                grown[: self.rows, :, : self.length] = old[: self.rows, :, : self.length]
                setattr(layer, name, grown)

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep the rows `idx` [B'] int64 in that order; a repeated index copies a row (a shared prefix)."""
        self.reserve(0, max(0, idx.numel() - self.rows))
        for layer in self.layers:
            layer.batch_select_indices(idx)
        self.rows = idx.numel()

    def append_rows(self, other: StaticKV, room: int = 0) -> int:
        """Add `other`'s rows after the live ones, right-aligned at the longer of the two lengths, with
        room for `room` more positions after it (allocated exactly).

        Returns the left padding (positions) added to the rows that were already here: their masks
        must grow by as much on the left; `other`'s rows get `max(length) - other.length`.
        """
        width = max(self.length, other.length)
        shift = width - self.length
        self.reserve(shift + room, other.rows, exact=True)
        for mine, theirs in zip(self.layers, other.layers):
            for name in ("k_store", "v_store"):
                store, src = getattr(mine, name), getattr(theirs, name)
                if shift:
                    store[: self.rows, :, shift:width] = store[: self.rows, :, : self.length].clone()
                rows = slice(self.rows, self.rows + other.rows)
                store[rows, :, width - other.length : width] = src[: other.rows, :, : other.length]
        self.length = width
        self.rows += other.rows
        return shift

    def trim_left(self, positions: int) -> None:
        """Drop the first `positions` positions of every row (the caller checked they are padding for all)."""
        if positions <= 0:
            return
        keep = self.length - positions
        for layer in self.layers:
            for name in ("k_store", "v_store"):
                store = getattr(layer, name)
                store[: self.rows, :, :keep] = store[: self.rows, :, positions : self.length].clone()
        self.length = keep


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The HF RMSNorm (float32 statistics, weight applied in the input dtype); one fused op for float32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@dataclass
class _Layer:
    """One decoder layer's tensors, fused where that saves matmul calls ([out, in] weights)."""

    ln1: torch.Tensor
    ln1_eps: float
    qkv_w: torch.Tensor  # [(H + 2 * Hkv) * D, hidden]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    ln2_eps: float
    gate_up_w: torch.Tensor | None  # [2 * intermediate, hidden]; None for a sparse expert block
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor | None
    down_b: torch.Tensor | None
    scaling: float
    experts: Any = None  # the layer's sparse expert block (its forward: [B, n, hidden] -> [B, n, hidden])
    q_norm: Any = None  # Qwen3-MoE: per-head RMSNorm modules of q and k
    k_norm: Any = None


def _is_dense(mlp: Any) -> bool:
    """A SiLU gate/up/down MLP (fused here), as opposed to a sparse expert block."""
    return all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastDecoder:
    """Forward of a supported HF causal LM over its live parameters; see the module docstring."""

    def __init__(self, model: PreTrainedModel) -> None:
        if not self.supports(model):
            raise ValueError(f"{type(model).__name__} is not supported by FastDecoder")
        config = model.config
        inner = model.model
        self._embed = inner.embed_tokens
        self._layers = list(inner.layers)
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._head = model.get_output_embeddings()
        self.num_layers = len(self._layers)
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.dtype = self._embed.weight.dtype
        self.device = self._embed.weight.device
        self._fused: list[_Layer] = []
        self._fused_key: tuple[int, ...] = ()
        self.batch_invariant = False  # see the module docstring; the engine sets it
        self.refresh()

    def _sources(self) -> list[torch.Tensor]:
        out = []
        for layer in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            dense = (mlp.gate_proj, mlp.up_proj) if _is_dense(mlp) else ()  # an expert block runs as it is
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, *dense):
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
            self._fused = [self._fuse(layer) for layer in self._layers]
        self._fused_key = key

    @staticmethod
    def _fuse(layer: Any) -> _Layer:
        """`layer`: a Hugging Face decoder layer (its submodules are dynamic attributes, hence Any)."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)

        def bias(lins: tuple[Any, ...]) -> torch.Tensor | None:
            if all(lin.bias is None for lin in lins):
                return None
            return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
                              for lin in lins])

        dense = _is_dense(mlp)
        return _Layer(
            ln1=layer.input_layernorm.weight, ln1_eps=float(layer.input_layernorm.variance_epsilon),
            qkv_w=torch.cat([lin.weight for lin in qkv]), qkv_b=bias(qkv),
            o_w=attn.o_proj.weight, o_b=attn.o_proj.bias,
            ln2=layer.post_attention_layernorm.weight, ln2_eps=float(layer.post_attention_layernorm.variance_epsilon),
            gate_up_w=torch.cat([lin.weight for lin in (mlp.gate_proj, mlp.up_proj)]) if dense else None,
            gate_up_b=bias((mlp.gate_proj, mlp.up_proj)) if dense else None,
            down_w=mlp.down_proj.weight if dense else None, down_b=mlp.down_proj.bias if dense else None,
            scaling=float(attn.scaling), experts=None if dense else mlp,
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
        )

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        """True for Qwen2/Llama/Mistral-style models with full attention everywhere and a SiLU MLP."""
        config = model.config
        if getattr(config, "model_type", None) not in _FAMILIES or getattr(config, "hidden_act", None) != "silu":
            return False
        if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"])):
            return False
        if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) != 1:
            return False
        moe = config.model_type in ("qwen3_moe", "mixtral")
        if config.model_type == "mixtral" and getattr(config, "sliding_window", None) is not None:
            return False  # Mixtral's sliding window: not the full attention computed here
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in needed) or model.get_output_embeddings() is None:
            return False
        for layer in inner.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
                return False
            if not (_is_dense(mlp) or (moe and hasattr(mlp, "gate") and hasattr(mlp, "experts"))):
                return False
            if (config.model_type in _QK_NORM) != (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
                return False
        return True

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
        b, n = ids.shape
        start = cache.length
        end = start + n
        cache.reserve(n)
        x = F.embedding(ids, self._embed.weight)
        cos, sin = self._rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = self._attention_mask(key_mask, start, n)
        heads, kv_heads, d = self.num_heads, self.kv_heads, self.head_dim
        for i, lay in enumerate(self._fused):
            kv = cache.layers[i]
            h = _rms_norm(x, lay.ln1, lay.ln1_eps)
            qkv = self._linear(h, lay.qkv_w, lay.qkv_b).view(b, n, heads + 2 * kv_heads, d).transpose(1, 2)
            qk = qkv[:, : heads + kv_heads]
            if lay.q_norm is not None:  # per head, over head_dim, before the rotation (as HF Qwen3-MoE)
                qk = torch.cat([lay.q_norm(qk[:, :heads]), lay.k_norm(qk[:, heads:])], dim=1)
            qk = qk * cos + _rotate_half(qk) * sin  # q and k rotated in one go
            kv.k_buf[:, :, start:end] = qk[:, heads:]
            kv.v_buf[:, :, start:end] = qkv[:, heads + kv_heads :]
            if self.batch_invariant and n == 1:
                o = invariant_ops.attend_decode(qk[:, :heads], kv.k_buf[:, :, :end], kv.v_buf[:, :, :end], key_mask,
                                                kv_heads, lay.scaling)
            elif self.batch_invariant:
                o = invariant_ops.attend_prefill(qk[:, :heads], kv.k_buf[:, :, :end], kv.v_buf[:, :, :end], key_mask,
                                                 start, kv_heads, lay.scaling)
            else:
                o = self._attend(qk[:, :heads], kv.k_buf[:, :, :end], kv.v_buf[:, :, :end], mask, lay.scaling)
            x = x + self._linear(o.transpose(1, 2).reshape(b, n, heads * d), lay.o_w, lay.o_b)
            h = _rms_norm(x, lay.ln2, lay.ln2_eps)
            if lay.experts is not None:
                x = x + lay.experts(h)
            else:
                assert lay.gate_up_w is not None and lay.down_w is not None
                gate, up = self._linear(h, lay.gate_up_w, lay.gate_up_b).chunk(2, dim=-1)
                x = x + self._linear(F.silu(gate) * up, lay.down_w, lay.down_b)
        cache.length = end
        if last_only:
            x = x[:, -1]
        x = _rms_norm(x, self._norm.weight, float(self._norm.variance_epsilon))
        return self._linear(x, self._head.weight, getattr(self._head, "bias", None))

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

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return invariant_ops.linear_blocks(x, weight, bias) if self.batch_invariant else F.linear(x, weight, bias)

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
