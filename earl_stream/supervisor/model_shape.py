"""The shape of a dense decoder-only transformer, read from a Hugging Face config.

Owns `ModelShape` (layers, widths, heads, vocabulary, biases; parameter counts) and the validation of
the config it comes from: `ModelShape.from_hf` refuses, in one ConfigError naming every field,
configs of architectures the memory model does not cover (MoE, MLA, sliding window, attention
dropout, encoder-decoder) and fields it does not know. What the shape costs in memory under a plan is
`memory_model`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from earl_stream.errors import ConfigError

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_SUPPORTED_TYPES = frozenset({"llama", "qwen2", "mistral"})
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
        return cls(hidden_size=h, num_layers=int(d["num_hidden_layers"]), num_heads=a, num_kv_heads=kv,
                   head_dim=int(d.get("head_dim") or h // a), intermediate_size=int(d["intermediate_size"]),
                   vocab_size=int(d["vocab_size"]), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   qkv_bias=bias or d.get("model_type") == "qwen2", o_bias=bias, mlp_bias=bool(d.get("mlp_bias")))

    def layout_problems(self, tp: int, sp: int = 1) -> list[str]:
        """Why this model cannot be split `tp`-way by tensor parallelism (column-wise q/k/v/gate/up,
        row-wise o/down, vocab-parallel embedding and LM head) and `sp`-way by Ulysses (heads
        exchanged inside attention); [] if it can. kv heads are all-to-all'ed only when sp divides
        them (else repeated), so only tp must divide them."""
        out = [f"num_attention_heads={self.num_heads} is not divisible by tp*sp={tp * sp}"] if self.num_heads % (tp * sp) else []
        for key, n in (("num_key_value_heads", self.num_kv_heads), ("vocab_size", self.vocab_size),
                       ("intermediate_size", self.intermediate_size), ("hidden_size", self.hidden_size)):
            if n % tp:
                out.append(f"{key}={n} is not divisible by tp={tp}")
        return out

    def layer_matrix_params(self) -> int:
        """Parameters of one layer's weight matrices (split by tensor parallelism)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size

    def layer_small_params(self) -> int:
        """Biases and norm weights of one layer (replicated under tensor parallelism)."""
        q, kv, h = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size
        return (2 * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
                + (2 * self.intermediate_size + h if self.mlp_bias else 0))

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

    def num_params(self) -> int:
        per_layer = self.layer_matrix_params() + self.layer_small_params()
        return self.num_layers * per_layer + self.embedding_params() + self.hidden_size


def _config_problems(d: Mapping[str, Any]) -> list[str]:
    def set_(key: str) -> bool:
        return d.get(key) not in (None, 0, 0.0, False, [], {}, "")

    problems: list[str] = []
    if missing := [k for k in _REQUIRED if not set_(k)]:
        problems.append(f"missing required fields {missing}")
    if set_("model_type") and d["model_type"] not in _SUPPORTED_TYPES:
        problems.append(f"model_type={d['model_type']!r} is not modelled (supported: {sorted(_SUPPORTED_TYPES)})")
    if moe := sorted(k for k in d if k.startswith(_UNSUPPORTED_PREFIXES) and set_(k)):
        problems.append(f"unsupported architecture (MoE/MLA) fields set: {moe}")
    known = _HARMLESS | set(_REQUIRED)
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
