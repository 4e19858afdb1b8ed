"""What the built-in engine's fast decoder understands of a Hugging Face decoder, read from the model itself.

It owns `read_quirks(model)`: either a `Quirks` (the model is a Llama-style decoder whose every departure from
Llama is one the fast decoder expresses as data: q/k norms, a head_dim independent of the hidden size, fused
q/k/v and gate/up projections, layers without rotary embeddings, the MLP's activation, norms after attention
and MLP, Granite's multipliers, a sparse expert block), or the list of reasons it is not.

The decision is an allow-list of understood quirks, never of model types: every config field must be known
(neutral, or understood with the value it has), and every module of a layer must be one of the known names
and classes. A new family, or a known family with a field or module not understood here, is refused; the
engine then runs the Hugging Face forward (`decode_path`), which also checks the fast decoder against that
forward on a probe before using it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import transformers
from torch import nn
from transformers import PreTrainedModel

_GENERIC = frozenset(transformers.PretrainedConfig().to_dict())  # fields every config has; none is model math
# Fields that do not change the forward in eval mode, or that the fast decoder reads from the modules.
_NEUTRAL = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "original_max_position_embeddings",
    "rms_norm_eps", "initializer_range", "use_cache", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "attention_bias", "mlp_bias", "attention_dropout", "resid_pdrop", "embd_pdrop",
    "hidden_dropout", "torch_dtype", "max_window_layers", "no_rope_layer_interval",
    "attention_multiplier",  # the attention module's `scaling`, which the fast decoder reads
    # sparse expert blocks run as their own modules
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
})
# Fields understood only with these values (the no-op ones).
_NOOP: dict[str, tuple[Any, ...]] = {
    "pretraining_tp": (1,), "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
    "use_bidirectional_attention": (False, None), "use_mrope": (False,), "use_sliding_window": (False, None),
}
# Fields the fast decoder implements (checked or read below).
_HANDLED = frozenset({"hidden_act", "sliding_window", "layer_types", "rope_parameters", "rope_scaling", "rope_theta",
                      "no_rope_layers", "embedding_multiplier", "residual_multiplier", "logits_scaling"})
_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_MOE_TYPES = ("qwen3_moe", "mixtral")  # whose expert block (router `gate` + `experts`) is known to run as a module
_PRE_NORM = frozenset({"input_layernorm", "post_attention_layernorm"})
_POST_NORM = frozenset({"post_attention_layernorm", "post_feedforward_layernorm"})  # OLMo 2


class QKNorm(enum.Enum):
    """Where the attention normalises q and k (RMSNorm), before the rotary embedding."""

    NONE = "none"
    HEAD = "head"  # per head over head_dim (Qwen3, Qwen3-MoE)
    FULL = "full"  # over all heads' projection output (OLMo 2)


@dataclass(frozen=True)
class Quirks:
    """A supported model's departures from a Llama decoder, as data for `fast_decoder`."""

    qk_norm: QKNorm
    post_norm: bool  # norms after attention and MLP output (OLMo 2) instead of before their input
    rope_layers: tuple[bool, ...]  # per layer: whether q and k are rotated (SmolLM3 leaves some layers without)
    embedding_multiplier: float = 1.0  # Granite: embeddings x this
    residual_multiplier: float = 1.0  # Granite: attention / MLP outputs x this before the residual add
    logits_scaling: float = 1.0  # Granite: logits / this

    def describe(self) -> str:
        """The quirks in a few words (for the engine's log line)."""
        parts = [f"q/k norm ({self.qk_norm.value})" if self.qk_norm is not QKNorm.NONE else "",
                 "post-norm" if self.post_norm else "", "no-rope layers" if not all(self.rope_layers) else "",
                 "multipliers" if (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling)
                 != (1.0, 1.0, 1.0) else ""]
        return ", ".join(p for p in parts if p) or "plain Llama layers"


def read_quirks(model: PreTrainedModel) -> Quirks | list[str]:
    """The model's quirks, or why the fast decoder cannot run it (each reason a short phrase)."""
    config = model.config
    problems = _config_problems(config)
    problems += _module_problems(model, getattr(config, "model_type", None))
    if problems:
        return problems
    layers = len(model.model.layers)
    rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 = this layer uses the rotary embedding
    attn = model.model.layers[0].self_attn
    qk = QKNorm.NONE
    if hasattr(attn, "q_norm"):
        qk = QKNorm.HEAD if attn.q_norm.weight.shape[0] == _head_dim(attn, config) else QKNorm.FULL
    return Quirks(qk, not hasattr(model.model.layers[0], "input_layernorm"),
                  tuple(bool(r) for r in rope) if rope is not None else (True,) * layers,
                  float(getattr(config, "embedding_multiplier", 1.0)), float(getattr(config, "residual_multiplier", 1.0)),
                  float(getattr(config, "logits_scaling", 1.0)))


def _head_dim(attn: Any, config: Any) -> int:
    return int(getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _config_problems(config: Any) -> list[str]:
    fields = config.to_dict()
    problems = []
    layer_types = fields.get("layer_types") or ["full_attention"]
    window = fields.get("sliding_window")
    if any(t != "full_attention" for t in layer_types) or (window is not None and fields.get("use_sliding_window")
                                                          is not False):
        problems.append("sliding-window layers not in the fast decoder")
    act = fields.get("hidden_act")
    if act not in _ACTIVATIONS and "hidden_activation" not in fields:  # Gemma's field: reported as unknown
        problems.append(f"activation {act!r} not in the fast decoder")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) not in _ROPE_TYPES \
            or rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"rotary embedding {rope!r} not in the fast decoder")
    rope_layers = fields.get("no_rope_layers")
    if rope_layers is not None and len(rope_layers) != fields.get("num_hidden_layers"):
        problems.append("no_rope_layers does not name every layer")
    odd = sorted(k for k, v in fields.items() if k in _NOOP and v not in _NOOP[k])
    unknown = sorted(k for k in fields if k not in _GENERIC | _NEUTRAL | _HANDLED | set(_NOOP))
    if odd or unknown:
        problems.append(f"config fields not understood by the fast decoder: {', '.join(odd + unknown)}")
    return problems


def _module_problems(model: PreTrainedModel, model_type: str | None) -> list[str]:
    inner = getattr(model, "model", None)
    names = {n for n, _ in inner.named_children()} if isinstance(inner, nn.Module) else set()
    if names != {"embed_tokens", "layers", "norm", "rotary_emb"}:
        return [f"model modules {sorted(names)} are not embed_tokens/layers/norm/rotary_emb"]
    assert inner is not None
    problems = []
    if type(inner.embed_tokens) is not nn.Embedding:
        problems.append(f"embedding {type(inner.embed_tokens).__name__} (scaled or custom) not in the fast decoder")
    if type(model.get_output_embeddings()) is not nn.Linear:
        problems.append("the output head is not a plain Linear")
    if not _is_rms_norm(inner.norm):
        problems.append(f"norm {type(inner.norm).__name__} not in the fast decoder")
    by_problem: dict[str, list[int]] = {}
    for i, layer in enumerate(inner.layers):
        for problem in _layer_problems(layer, model_type):
            by_problem.setdefault(problem, []).append(i)
    for problem, where in by_problem.items():
        scope = "every layer" if len(where) == len(inner.layers) else f"layers {', '.join(map(str, where))}"
        problems.append(f"{scope}: {problem}")
    return problems


def _layer_problems(layer: nn.Module, model_type: str | None) -> list[str]:
    children = dict(layer.named_children())
    norms = {n for n in children if n not in ("self_attn", "mlp") and not isinstance(children[n], nn.Dropout)}
    problems = []
    if norms not in (_PRE_NORM, _POST_NORM) or "self_attn" not in children or "mlp" not in children:
        return [f"modules {sorted(children)} are not a pre-norm or post-norm (OLMo 2) layer"]
    problems += [f"norm {type(children[n]).__name__} not in the fast decoder" for n in norms
                 if not _is_rms_norm(children[n])]
    attn, mlp = children["self_attn"], children["mlp"]
    attn_names = {n for n, _ in attn.named_children()}
    projections = attn_names - {"q_norm", "k_norm"}
    if projections not in ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"qkv_proj", "o_proj"}) \
            or not all(type(getattr(attn, n)) is nn.Linear for n in projections) or not hasattr(attn, "scaling"):
        problems.append(f"attention modules {sorted(attn_names)} not in the fast decoder")
    if attn_names & {"q_norm", "k_norm"} and not (_is_rms_norm(getattr(attn, "q_norm", None))
                                                   and _is_rms_norm(getattr(attn, "k_norm", None))):
        problems.append("q/k norms not RMSNorms of the fast decoder")
    if not (is_dense_mlp(mlp) or (model_type in _MOE_TYPES and hasattr(mlp, "gate") and hasattr(mlp, "experts"))):
        problems.append(f"MLP modules {sorted(n for n, _ in mlp.named_children())} not in the fast decoder")
    return problems


def is_dense_mlp(mlp: Any) -> bool:
    """A gated MLP (separate gate/up or fused gate_up, then down, with an activation module)."""
    names = {n for n, _ in mlp.named_children()} if isinstance(mlp, nn.Module) else set()
    projections = names - {"act_fn", "activation_fn"}
    return (len(names - projections) == 1 and projections in ({"gate_proj", "up_proj", "down_proj"},
                                                              {"gate_up_proj", "down_proj"})
            and all(type(getattr(mlp, n)) is nn.Linear for n in projections))


def _is_rms_norm(norm: Any) -> bool:
    """An HF Llama-style RMSNorm: `weight * normalised(x)` with `variance_epsilon` (not Gemma's `(1 + weight)`)."""
    if not isinstance(norm, nn.Module) or not type(norm).__name__.endswith("RMSNorm"):
        return False
    params = dict(norm.named_parameters())
    return set(params) == {"weight"} and hasattr(norm, "variance_epsilon") and not any(True for _ in norm.children())
