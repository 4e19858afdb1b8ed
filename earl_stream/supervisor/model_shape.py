"""The shape of a decoder-only transformer (dense, or with routed experts), read from a Hugging Face config.

Owns `ModelShape` (layers, widths, heads, vocabulary, biases, experts; total and active parameter
counts) and the validation of the config it comes from: `ModelShape.from_hf` refuses, in one
ConfigError naming every field, configs of architectures the memory model does not cover (MLA and
shared experts, sliding window, attention dropout, encoder-decoder) and fields it does not know.
Mixture-of-experts models of the Qwen3-MoE and Mixtral families are covered: every expert's weights,
gradients and optimizer state count (`num_params`), while activations and compute see the `top_k`
experts a token goes through (`intermediate_size` is then the active MLP width per token, top_k x the
expert width, and `active_params` the parameters one token uses); tensor and sequence parallel
layouts of their expert blocks are refused (`layout_problems`). What the shape costs in memory under a plan is
`memory_model`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from earl_stream.errors import ConfigError

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_SUPPORTED_TYPES = frozenset({"llama", "qwen2", "mistral", "qwen3_moe", "mixtral"})
# Fields of the routed-expert families above (read by `_moe_fields`); DeepSeek-style MLA / shared experts stay unsupported
_MOE_FIELDS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                         "output_router_logits", "router_jitter_noise"})
# Fields that never change training memory (generic PretrainedConfig keys, init, rope, token ids).
_HARMLESS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict", "transformers_version",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "hidden_act", "initializer_range", "rms_norm_eps",
    "max_position_embeddings", "use_cache", "rope_theta", "rope_scaling", "rope_parameters", "pretraining_tp",
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias", "max_window_layers",
    "use_sliding_window", "sliding_window", "layer_types", "attention_dropout", "is_encoder_decoder",
    "_attn_implementation_autoset", "attn_implementation", "_attn_implementation", "tokenizer_class",
    "use_return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "add_cross_attention",
})
# Fields of architectures this model does not cover (MoE, MLA, ...): named in the error when set.
_UNSUPPORTED_PREFIXES = ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "moe_",
                         "router_", "shared_expert", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                         "qk_nope_head_dim", "v_head_dim", "num_experts_per_tok", "decoder_sparse_step",
                         "mlp_only_layers", "topk_", "first_k_dense", "expert")
_GATED_ACTS = frozenset({"silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu"})


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The dimensions of a dense decoder-only transformer with a gated (SwiGLU) MLP."""

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
    qk_norm: bool = False  # Qwen3: RMSNorm weights [head_dim] on q and k

    @classmethod
    def from_hf(cls, config: Any, *, ignore_fields: Iterable[str] = ()) -> ModelShape:
        """Read a `transformers.PretrainedConfig` or a config dict (config.json's keys).

        Raises ConfigError naming every missing required field, every set field of an unsupported
        architecture (MoE, MLA, sliding window, attention dropout, encoder-decoder) and every unknown
        field; pass `ignore_fields` for unknown fields known not to change memory.
        """
        d = dict(config.to_dict()) if hasattr(config, "to_dict") else dict(config)
        for k in ignore_fields:
            d.pop(k, None)
        problems = _config_problems(d)
        h, a = int(d.get("hidden_size") or 0), int(d.get("num_attention_heads") or 0)
        kv = int(d.get("num_key_value_heads") or a)
        if not problems and a % kv:
            problems.append(f"num_attention_heads={a} is not a multiple of num_key_value_heads={kv}")
        if problems:
            raise ConfigError("memory model cannot use this model config: " + "; ".join(problems))
        bias = bool(d.get("attention_bias", False))
        fields: dict[str, Any] = dict(
            hidden_size=h, num_layers=int(d["num_hidden_layers"]), num_heads=a, num_kv_heads=kv,
            head_dim=int(d.get("head_dim") or h // a), intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=bias or d.get("model_type") == "qwen2", o_bias=bias, mlp_bias=bool(d.get("mlp_bias")))
        return cls(**{**fields, **_moe_fields(d)})

    @property
    def is_moe(self) -> bool:
        return self.moe_layers > 0

    def layout_problems(self, tp: int, sp: int = 1) -> list[str]:
        """Why this model cannot be split `tp`-way by tensor parallelism (column-wise q/k/v/gate/up,
        row-wise o/down, vocab-parallel embedding and LM head) and `sp`-way by Ulysses (heads
        exchanged inside attention); [] if it can. kv heads are all-to-all'ed only when sp divides
        them (else repeated), so only tp must divide them."""
        out = [f"num_attention_heads={self.num_heads} is not divisible by tp*sp={tp * sp}"] if self.num_heads % (tp * sp) else []
        if self.is_moe and (tp > 1 or sp > 1):
            out.append(f"tp={tp}, sp={sp}: the expert blocks of a mixture-of-experts model are not tensor or sequence "
                       "parallel in this version (use dp / fsdp)")
        for key, n in (("num_key_value_heads", self.num_kv_heads), ("vocab_size", self.vocab_size),
                       ("intermediate_size", self.intermediate_size), ("hidden_size", self.hidden_size)):
            if n % tp:
                out.append(f"{key}={n} is not divisible by tp={tp}")
        return out

    def layer_matrix_params(self, *, active: bool = False) -> int:
        """Parameters of one layer's weight matrices (split by tensor parallelism); with experts, the mean
        over layers of every expert and the router (`active`: of the top_k experts a token uses)."""
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
        q, kv, h = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size
        return (2 * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
                + (2 * self.intermediate_size + h if self.mlp_bias else 0) + (2 * self.head_dim if self.qk_norm else 0))

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def lora_params(self, rank: int, targets: Iterable[str]) -> int:
        """Parameters of rank-`rank` LoRA adapters (A [r, in] + B [out, r]) on the named projections of
        every layer (names the Llama family uses; others add nothing)."""
        h, q, kv, inter = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
                "up_proj": (h, inter), "down_proj": (inter, h)}
        per_layer = sum(rank * sum(dims[t]) for t in set(targets) if t in dims)
        return self.num_layers * per_layer

    def num_params(self, *, active: bool = False) -> int:
        """All parameters (every expert); `active`: those one token uses (its top_k experts)."""
        per_layer = self.layer_matrix_params(active=active) + self.layer_small_params()
        return self.num_layers * per_layer + self.embedding_params() + self.hidden_size

    def active_params(self) -> int:
        return self.num_params(active=True)


def _moe_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """ModelShape's expert fields from a Qwen3-MoE / Mixtral config dict ({} for a dense one); for an MoE
    model `intermediate_size` becomes the active MLP width per token (what activations hold)."""
    from earl_stream.model.moe_config import moe_layers, num_experts

    layers = moe_layers(d)
    out: dict[str, Any] = {"qk_norm": d.get("model_type") == "qwen3_moe"}
    if not layers:
        return out
    top_k = int(d.get("num_experts_per_tok") or 2)
    size = int(d.get("moe_intermediate_size") or d["intermediate_size"])
    return {**out, "num_experts": num_experts(d), "top_k": top_k, "expert_size": size, "moe_layers": len(layers),
            "intermediate_size": top_k * size if len(layers) == int(d["num_hidden_layers"]) else int(d["intermediate_size"])}


def _config_problems(d: Mapping[str, Any]) -> list[str]:
    def set_(key: str) -> bool:
        return d.get(key) not in (None, 0, 0.0, False, [], {}, "")

    problems: list[str] = []
    if missing := [k for k in _REQUIRED if not set_(k)]:
        problems.append(f"missing required fields {missing}")
    if set_("model_type") and d["model_type"] not in _SUPPORTED_TYPES:
        problems.append(f"model_type={d['model_type']!r} is not modelled (supported: {sorted(_SUPPORTED_TYPES)})")
    moe_ok = _MOE_FIELDS if d.get("model_type") in ("qwen3_moe", "mixtral") else frozenset()
    if moe := sorted(k for k in d if k.startswith(_UNSUPPORTED_PREFIXES) and k not in moe_ok and set_(k)):
        problems.append(f"unsupported architecture (MoE/MLA) fields set: {moe}")
    known = _HARMLESS | set(_REQUIRED) | (_MOE_FIELDS if d.get("model_type") in ("qwen3_moe", "mixtral") else set())
    if unknown := sorted(k for k in d if k not in known and not k.startswith(_UNSUPPORTED_PREFIXES)):
        problems.append(f"unknown fields {unknown} (pass ignore_fields=... if they do not change memory)")
    other_types = set(d.get("layer_types") or ()) - {"full_attention"}
    if set_("sliding_window") and (d.get("use_sliding_window", True) or other_types):
        problems.append(f"sliding_window={d['sliding_window']} is set: sliding-window attention is not modelled")
    elif other_types:
        problems.append(f"layer_types {sorted(other_types)}: only full attention is modelled")
    if set_("attention_dropout"):
        problems.append(f"attention_dropout={d['attention_dropout']}: dropout masks are not modelled")
    if set_("is_encoder_decoder") or set_("add_cross_attention"):
        problems.append("encoder-decoder / cross-attention models are not modelled")
    if d.get("hidden_act", "silu") not in _GATED_ACTS:
        problems.append(f"hidden_act={d.get('hidden_act')!r} is not modelled (supported: {sorted(_GATED_ACTS)})")
    return problems
