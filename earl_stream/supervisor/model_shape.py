"""The shape of a decoder-only transformer (dense, or with routed experts), read from the model itself.

Owns `ModelShape` (layers, widths, heads, vocabulary, biases, experts, the exact parameter tensors;
total and active parameter counts; which layouts it can be split into) and `ModelShape.from_hf`, which
builds it from a `PretrainedConfig` or a config dict through `model_structure.read_structure` (the
model instantiated on the meta device: no family is named anywhere). Config fields the memory model
does not interpret do not refuse the model: they are its `quirks`, and a shape with quirks is
`calibrate`d from the first measured step (`selector.TrainerSelector.on_measured_peak`).
A vision-language model is its language model's shape with the tower's and connector's tensors added, and
its tower's dimensions (`VisionTower`: what its activations cost per image token, for the memory model).
Mixture-of-experts models of the Qwen3-MoE and Mixtral families are covered: every expert's weights,
gradients and optimizer state count (`num_params`), while activations and compute see the `top_k`
experts a token goes through (`intermediate_size` is then the active MLP width per token, top_k x the
expert width, and `active_params` the parameters one token uses); tensor and sequence parallel
layouts of their expert blocks are refused (`layout_problems`). What the shape costs in memory under a
plan is `memory_model`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from earl_stream.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class VisionTower:
    """The vision tower of a vision-language model and its connector: what the trainer's forward saves per image
    token, and its FLOPs. Two families (`family`):

    - "idefics3" (Idefics3 / SmolVLM: a SigLIP ViT, pre-LayerNorm layers, a GELU MLP; a pixel-shuffle connector).
      Each image token is `patches_per_token` patches (the pixel shuffle's scale_factor squared); a tile is
      `tile_patches` patches (image_size / patch_size, squared), attended to within the tile. Per patch, measured
      with saved-tensor hooks on the tower as transformers runs it: each layer saves (8 h + 2 I) e bytes
      (LayerNorm inputs and outputs, q, k, v, the attention output and the out_proj's input, fc1's output and the
      GELU's) and the attention's fp32 log-sum-exp (4 bytes per head), or under eager attention the fp32 softmax
      of the tile's scores (and its cast copy when e < 4); outside the layers, the patch embedding's pixel input,
      the post-LayerNorm's input and the connector's.
    - "qwen2_vl" (Qwen2-VL / Qwen2.5-VL: a ViT of RMSNorm layers with a SwiGLU MLP and 2-D rotary positions,
      attention within windows of `tile_patches` patches except in `full_layers` layers; a 2x2 patch merger).
      Each image token is `patches_per_token` (merge size squared) patches. Per patch, measured the same way on
      Qwen2.5-VL's tower: each layer saves (13 h + 4 I) e bytes, two fp32 RMS statistics and the fp32
      log-sum-exp per head, or under eager attention the softmax over the span it attends (a window; in a
      full-attention layer the whole image, `image_patches`) in place of the output and the log-sum-exp; outside
      the layers, the pixel input (channels x temporal patch x patch squared), 5 h e bytes and two fp32 statistics
      (the merger's norm and MLP) and the fp32 rotary tables (2 x head_dim).

    Full recomputation keeps each layer's input only."""

    layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    channels: int
    tile_patches: int
    patches_per_token: int
    family: str = "idefics3"
    temporal_patch_size: int = 1
    full_layers: int = 0  # qwen2_vl: layers attending over the whole image, not a window

    @classmethod
    def from_config(cls, cfg: Any) -> VisionTower | None:
        """The tower of an Idefics3-style or Qwen2-VL-style config (None for other families: their towers are not
        modelled)."""
        kind = getattr(cfg, "model_type", "")
        v: Any = getattr(cfg, "vision_config", None)
        if kind in ("qwen2_vl", "qwen2_5_vl") and v is not None:
            merge = int(v.spatial_merge_size)
            qwen2 = kind == "qwen2_vl"  # Qwen2-VL: every layer attends over the whole image, a GELU MLP
            if qwen2:
                return None  # its tower (embed_dim, mlp_ratio, LayerNorm) was not measured: calibrated instead
            window = int(v.window_size) // int(v.patch_size)
            return cls(layers=int(v.depth), hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
                       num_heads=int(v.num_heads), patch_size=int(v.patch_size), channels=int(getattr(v, "in_channels", 3)),
                       tile_patches=window * window, patches_per_token=merge * merge, family="qwen2_vl",
                       temporal_patch_size=int(v.temporal_patch_size), full_layers=len(v.fullatt_block_indexes or ()))
        if kind not in VISION_TOWER_TYPES:
            return None
        scale = int(getattr(cfg, "scale_factor", 1) or 1)
        return cls(layers=int(v.num_hidden_layers), hidden_size=int(v.hidden_size),
                   intermediate_size=int(v.intermediate_size), num_heads=int(v.num_attention_heads),
                   patch_size=int(v.patch_size), channels=int(getattr(v, "num_channels", 3)),
                   tile_patches=(int(v.image_size) // int(v.patch_size)) ** 2, patches_per_token=scale * scale)

    @property
    def tile_tokens(self) -> int:
        """Image tokens of one tile (Qwen2-VL: of one attention window)."""
        return self.tile_patches // self.patches_per_token

    def saved_bytes_per_token(self, activation_bytes: int, *, eager: bool, full_recompute: bool,
                              image_patches: float = 0.0) -> float:
        """Bytes the forward saves for the backward per image token (all its patches, every layer).
        `image_patches`: the patches of the largest image (Qwen2-VL's full-attention layers under eager attention
        attend over it; 0: a window's)."""
        if self.family == "qwen2_vl":
            return self._qwen_saved_bytes(activation_bytes, eager=eager, full_recompute=full_recompute,
                                          image_patches=image_patches)
        e, h = activation_bytes, self.hidden_size
        if full_recompute:
            layer = h * e
        else:
            layer = (8 * h + 2 * self.intermediate_size) * e + 4 * self.num_heads
            if eager:
                layer += self.num_heads * self.tile_patches * (4 + (e if e < 4 else 0))
        outside = self.channels * self.patch_size ** 2 * e + 2 * h * e
        return self.patches_per_token * (self.layers * layer + outside)

    def _qwen_saved_bytes(self, e: int, *, eager: bool, full_recompute: bool, image_patches: float) -> float:
        h, inter = self.hidden_size, self.intermediate_size
        layers: float
        if full_recompute:
            layers = self.layers * h * e
        elif eager:
            softmax = self.num_heads * (4 + (e if e < 4 else 0))
            full_span = max(float(image_patches), float(self.tile_patches))
            base = (12 * h + 4 * inter) * e + 8
            layers = self.layers * base + softmax * ((self.layers - self.full_layers) * self.tile_patches
                                                    + self.full_layers * full_span)
        else:
            layers = self.layers * ((13 * h + 4 * inter) * e + 4 * self.num_heads + 8)
        pixels = self.channels * self.temporal_patch_size * self.patch_size ** 2 * e
        rotary = 2 * (h // self.num_heads) * 4
        return self.patches_per_token * (layers + pixels + 5 * h * e + rotary + 8)

    def flops_per_token(self, text_hidden: int) -> float:
        """Forward FLOPs of the tower and the connector per image token: per patch the patch embedding (2 P^2 C h)
        and each layer's projections (8 h^2), MLP (4 h I; Qwen2-VL's SwiGLU: 6 h I) and attention's two products
        over the tile (4 T h; Qwen2-VL: over a window); the connector's linear from the shuffled patches (h x
        patches per token) to the decoder's width (Qwen2-VL's merger: a 4 h x 4 h linear first). Norms and
        activations are left out, as the decoder's count leaves them out."""
        h, t = self.hidden_size, self.tile_patches
        qwen = self.family == "qwen2_vl"
        per_patch = self.layers * (8 * h * h + (6 if qwen else 4) * h * self.intermediate_size + 4 * t * h)
        per_patch += 2 * self.patch_size ** 2 * self.channels * self.temporal_patch_size * h
        if qwen:  # the merger's first linear, 4 h to 4 h per image token
            per_patch += 8 * h * h
        return self.patches_per_token * (per_patch + 2 * h * text_hidden)


VISION_TOWER_TYPES = ("idefics3", "smolvlm")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer with a gated MLP, and its exact parameter tensors.

    `tensors`: (name, shape) of every parameter in `named_parameters()` order (a tied LM head once);
    empty for a shape built from dimensions alone, whose counts then follow the Llama formulas.
    `quirks`: config fields the memory model does not interpret (`calibrate`: predictions are scaled
    by the first measured step). `tp_problems` / `sp_problems`: why the trainer cannot split this
    family by tensor / sequence parallelism at all (`workers.tensor_parallel.family_problems`).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has q/k/v biases; Llama's `attention_bias` adds o_proj's too
    o_bias: bool = False
    mlp_bias: bool = False
    # routed experts (0 = dense): experts per MoE layer, routed per token, each expert's MLP width, MoE layers
    num_experts: int = 0
    top_k: int = 0
    expert_size: int = 0
    moe_layers: int = 0
    qk_norm: bool = False  # Qwen3, Gemma 3, OLMo 2: RMSNorms on q and k (their inputs are saved for backward)
    model_type: str = ""
    fused_qkv: bool = False  # Phi-3's qkv_proj
    fused_gate_up: bool = False  # Phi-3's gate_up_proj
    pre_norms: int = 2  # norms per layer whose output feeds a linear (Llama: input and pre-MLP)
    post_norms: int = 0  # norms per layer on a sub-layer's output (Gemma 3's and OLMo 2's post norms)
    sliding_window: int = 0  # tokens a sliding-window layer attends back (0: none)
    sliding_layers: int = 0  # layers with that window
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()
    layer_prefix: str = ""  # the decoder layers' qualified name + "." (`model.layers.`)
    quirks: tuple[str, ...] = ()
    tp_problems: tuple[str, ...] = ()
    sp_problems: tuple[str, ...] = ()
    vision: VisionTower | None = None  # a vision-language model's tower (its activations per image token)

    @classmethod
    def from_hf(cls, config: Any, *, ignore_fields: Iterable[str] = ()) -> ModelShape:
        """Read a `transformers.PretrainedConfig` or a config dict (config.json's keys; `model_type`
        defaults to llama): the model is built on the meta device and its structure read
        (`model_structure.read_structure`). `ignore_fields`: fields to drop first.

        Raises ConfigError naming every missing required field, a model type transformers does not
        know, and what is not modelled (encoder-decoder, MLA, experts of other families).
        """
        from earl_stream.supervisor.model_structure import hf_config, read_structure

        cfg = hf_config(config, ignore_fields=ignore_fields)
        if getattr(cfg, "vision_config", None) is not None:  # a vision-language model: its decoder, and its tower
            return cls._vision(cfg)
        fields = read_structure(cfg)
        moe = fields.pop("moe")
        d = dict(cfg.to_dict())
        extra = _moe_fields(d, num_layers=fields["num_layers"]) if moe else {}
        return cls(**{**fields, **extra})

    @classmethod
    def _vision(cls, cfg: Any) -> ModelShape:
        """A vision-language model: the shape of its language model, whose parameter tensors also hold the vision
        tower's and the connector's (their weights, gradients and optimizer state count), and the tower's
        dimensions (`VisionTower`: Idefics3 / SmolVLM, Qwen2.5-VL); another family's tower activations are not modelled (a
        quirk: predictions are calibrated from the first measured step)."""
        from earl_stream.supervisor.model_structure import read_structure, vision_tensors

        fields = read_structure(cfg.get_text_config())
        fields.pop("moe")
        fields["tensors"] = fields["tensors"] + vision_tensors(cfg)
        fields["vision"] = VisionTower.from_config(cfg)
        if fields["vision"] is None:
            fields["quirks"] = (*fields["quirks"], f"{cfg.model_type}'s vision tower: its activations are not modelled")
        fields["tp_problems"] = (*fields["tp_problems"], f"{cfg.model_type} is a vision-language model (dp / fsdp / sp)")
        return cls(**fields)

    def __hash__(self) -> int:  # computed once: plan caches look shapes up per plan, and `tensors` is long
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return int(cached)

    def __getstate__(self) -> dict[str, Any]:  # str hashes differ between processes: never ship the cached one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def calibrate(self) -> bool:
        """The memory model does not interpret some of this family's quirks: scale its predictions by
        the first measured step's peak."""
        return bool(self.quirks)

    @property
    def is_moe(self) -> bool:
        return self.moe_layers > 0

    def layout_problems(self, tp: int, sp: int = 1) -> list[str]:
        """Why this model cannot be split `tp`-way by tensor parallelism (the family's own plan, vocab-parallel
        embedding and LM head) and `sp`-way by Ulysses (heads exchanged inside attention); [] if it can.
        kv heads are all-to-all'ed only when sp divides them (else repeated), so only tp must divide them."""
        out = [f"num_attention_heads={self.num_heads} is not divisible by tp*sp={tp * sp}"] if self.num_heads % (tp * sp) else []
        if self.is_moe and (tp > 1 or sp > 1):
            out.append(f"tp={tp}, sp={sp}: the expert blocks of a mixture-of-experts model are not tensor or sequence "
                       "parallel in this version (use dp / fsdp)")
        out += [f"tp={tp}: {p}" for p in self.tp_problems if tp > 1]
        out += [f"sp={sp}: {p}" for p in self.sp_problems if sp > 1]
        for key, n in (("num_key_value_heads", self.num_kv_heads), ("vocab_size", self.vocab_size),
                       ("intermediate_size", self.intermediate_size), ("hidden_size", self.hidden_size)):
            if n % tp:
                out.append(f"{key}={n} is not divisible by tp={tp}")
        return out

    def _layer_sum(self, *, matrices: bool) -> int:
        """Elements of the decoder layers' matrices (ndim >= 2) or vectors, all layers together."""
        return sum(_numel(s) for n, s in self.tensors
                   if n.startswith(self.layer_prefix) and (len(s) >= 2) == matrices)

    def layer_matrix_params(self, *, active: bool = False) -> int:
        """Parameters of one layer's weight matrices (split by tensor parallelism); with experts, the mean
        over layers of every expert and the router (`active`: of the top_k experts a token uses)."""
        if self.tensors and not (active and self.is_moe):
            return -(-self._layer_sum(matrices=True) // self.num_layers)
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if not self.is_moe:
            return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
        experts = self.top_k if active else self.num_experts
        dense = self.num_layers - self.moe_layers  # Qwen3-MoE's mlp_only_layers: a dense MLP of the per-token width
        mlp = self.moe_layers * (experts * 3 * h * self.expert_size + h * self.num_experts) \
            + dense * 3 * h * self.intermediate_size
        return h * (q + 2 * kv) + q * h + -(-mlp // self.num_layers)

    def layer_small_params(self) -> int:
        """Biases and norm weights of one layer (replicated under tensor parallelism)."""
        if self.tensors:
            return -(-self._layer_sum(matrices=False) // self.num_layers)
        q, kv, h = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size
        return (2 * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
                + (2 * self.intermediate_size + h if self.mlp_bias else 0) + (2 * self.head_dim if self.qk_norm else 0))

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def lora_params(self, rank: int, targets: Iterable[str]) -> int:
        """Parameters of rank-`rank` LoRA adapters (A [r, in] + B [out, r]) on the named projections of
        every layer (the modules' own names: `q_proj`, Phi-3's `qkv_proj`, ...; others add nothing)."""
        wanted = set(targets)
        if self.tensors:
            return sum(rank * (s[0] + s[1]) for n, s in self.tensors
                       if n.startswith(self.layer_prefix) and n.endswith(".weight") and len(s) == 2
                       and n.split(".")[-2] in wanted)
        h, q, kv, inter = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
                "up_proj": (h, inter), "down_proj": (inter, h)}
        per_layer = sum(rank * sum(dims[t]) for t in wanted if t in dims)
        return self.num_layers * per_layer

    def num_params(self, *, active: bool = False) -> int:
        """All parameters (every expert; exact when `tensors` are known); `active`: those one token uses
        (its top_k experts)."""
        if self.tensors and not (active and self.is_moe):
            return sum(_numel(s) for _, s in self.tensors)
        per_layer = self.layer_matrix_params(active=active) + self.layer_small_params()
        if self.tensors:  # active MoE: the exact non-layer parameters, the layers' active share
            outside = sum(_numel(s) for n, s in self.tensors if not n.startswith(self.layer_prefix))
            return self.num_layers * per_layer + outside
        return self.num_layers * per_layer + self.embedding_params() + self.hidden_size

    def active_params(self) -> int:
        return self.num_params(active=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _moe_fields(d: Mapping[str, Any], *, num_layers: int) -> dict[str, Any]:
    """ModelShape's expert fields from a Qwen3-MoE / Mixtral config dict; `intermediate_size` becomes the
    active MLP width per token (what activations hold). ConfigError for experts `model.moe` does not route."""
    from earl_stream.model.moe_config import moe_layers, num_experts

    layers = moe_layers(d)
    if not layers:
        raise ConfigError(f"model_type={d.get('model_type')!r} has experts whose routing model.moe does not record "
                          "or replay: mixture-of-experts models of other families are not modelled")
    top_k = int(d.get("num_experts_per_tok") or 2)
    size = int(d.get("moe_intermediate_size") or d["intermediate_size"])
    return {"num_experts": num_experts(d), "top_k": top_k, "expert_size": size, "moe_layers": len(layers),
            "intermediate_size": top_k * size if len(layers) == num_layers else int(d["intermediate_size"])}
