"""A causal LM's structure, read from the model itself: instantiated on the meta device from its config.

Owns `hf_config` (a transformers config from a `PretrainedConfig` or a config dict) and
`read_structure` (`ModelShape`'s fields: every parameter tensor's name and shape, the decoder layers,
attention and MLP structure (separate or fused q/k/v and gate/up, biases, q/k norms, head_dim,
norms before and after each sub-layer), tied embeddings, sliding windows; the config fields the
memory model does not interpret, as quirks; why tensor or sequence parallelism cannot split it).
Nothing here names a model family: any decoder-only causal LM transformers knows is read the same
way. `model_shape` holds the shape; `workers.tensor_parallel.family_problems` says which layouts the
trainer can lay a family out in; what the shape costs in memory is `memory_model`'s.

Refused (ConfigError, every reason named): a model type transformers does not know, encoder-decoder
and cross-attention models, MLA attention (kv_lora_rank), and mixture-of-experts families whose
routers `model.moe` does not hook (shared experts included).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from earl_stream.errors import ConfigError

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# Config fields the shape reads from the model itself, or that change no tensor autograd saves: sizes,
# rope, init, token ids, scalar multipliers and scalings, which layers skip rope, the sliding windows
# (a window masks the scores; it does not shrink what a training step holds).
_INTERPRETED = frozenset({
    *_REQUIRED, "num_key_value_heads", "head_dim", "attention_bias", "mlp_bias", "tie_word_embeddings",
    "hidden_act", "hidden_activation", "max_position_embeddings", "original_max_position_embeddings",
    "initializer_range", "rms_norm_eps", "layer_norm_eps", "norm_eps", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "pretraining_tp",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "sliding_window_pattern",
    "_sliding_window_pattern", "no_rope_layers", "no_rope_layer_interval", "query_pre_attn_scalar",
    "attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling", "tokenizer_class",
    "_name_or_path", "attn_implementation", "_attn_implementation", "_attn_implementation_autoset", "torch_dtype",
    # routed experts of the families `model.moe` hooks (read by `model_shape._moe_fields`)
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
})
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "shared_expert_intermediate_size")
_WINDOWED, _FULL = "sliding_attention", "full_attention"


def _set(v: Any) -> bool:
    return v not in (None, 0, 0.0, False, [], {}, "", ())


def hf_config(config: Any, *, ignore_fields: Iterable[str] = ()) -> Any:
    """A transformers `PretrainedConfig` from one (returned as is) or from a config dict (config.json's
    keys; `model_type` defaults to llama), built with `AutoConfig.for_model`. ConfigError names every
    missing required field, or a model type transformers does not know."""
    from transformers import AutoConfig, PretrainedConfig

    ignore = set(ignore_fields)
    if isinstance(config, PretrainedConfig) and not ignore:
        return config
    d = {k: v for k, v in (config.to_dict() if hasattr(config, "to_dict") else dict(config)).items()
         if k not in ignore}
    kind = d.pop("model_type", None) or "llama"
    try:
        cls = AutoConfig.for_model(kind).__class__
    except (ValueError, KeyError):
        raise ConfigError(f"model_type={kind!r} is not a model type this transformers knows: its structure cannot "
                          "be read (upgrade transformers, or use a supported architecture)") from None
    if isinstance(d.get("text_config"), Mapping) and d.get("vision_config") is not None:
        try:  # a vision-language model: its language model's config holds the fields (checked when it is read)
            return AutoConfig.for_model(kind, **{k: v for k, v in d.items() if k != "transformers_version"})
        except Exception as exc:
            raise ConfigError(f"model_type={kind!r}: transformers refuses this config ({exc})") from None
    aliases: Mapping[str, str] = getattr(cls, "attribute_map", {}) or {}
    if missing := [k for k in _REQUIRED if not _set(d.get(k)) and not _set(d.get(aliases.get(k, "")))]:
        raise ConfigError(f"memory model cannot use this model config: missing required fields {missing}")
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "architectures")}
    if "num_attention_heads" in d and d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]  # a config.json without it means one kv head per head
    try:
        return AutoConfig.for_model(kind, **d)
    except Exception as exc:  # ValueError, TypeError, huggingface_hub's StrictDataclassError: the config's own checks
        raise ConfigError(f"model_type={kind!r}: transformers refuses this config ({exc})") from None


class _DecoderWithHead(torch.nn.Module):
    """A vision-language model's language model laid out as a causal LM (`model`, the decoder; `lm_head`), for a
    text config transformers builds no causal LM from (Qwen2-VL's and Qwen2.5-VL's)."""

    def __init__(self, cfg: Any) -> None:
        from transformers import AutoModel

        super().__init__()
        self.model: Any = AutoModel.from_config(cfg)
        self.lm_head = torch.nn.Linear(int(cfg.hidden_size), int(cfg.vocab_size), bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.get_input_embeddings().weight

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def meta_model(cfg: Any) -> torch.nn.Module:
    """The causal LM of `cfg` on the meta device: shapes only, no memory, no weights read."""
    from transformers import AutoModelForCausalLM

    from earl_stream.model.mrope import MROPE_TYPES

    try:
        with torch.device("meta"):
            if str(getattr(cfg, "model_type", "")) in {f"{t}_text" for t in MROPE_TYPES}:
                return _DecoderWithHead(cfg)  # a Qwen2-VL-family model's own text model
            return AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # ValueError (no causal LM for the type), or the model's own checks failing
        raise ConfigError(f"model_type={cfg.model_type!r}: transformers builds no causal LM from this config "
                          f"({exc})") from None


def vision_tensors(cfg: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of a vision-language model's parameters outside its language model (the vision tower, the
    connector), read from the model built on the meta device."""
    from transformers import AutoModelForImageTextToText

    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(cfg)
    except Exception as exc:
        raise ConfigError(f"model_type={cfg.model_type!r}: transformers builds no vision-language model from this "
                          f"config ({exc})") from None
    text = {id(p) for p in model.get_decoder().parameters()} | {id(model.get_output_embeddings().weight)}
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters() if id(p) not in text)


def _refusals(cfg: Any) -> list[str]:
    out = []
    if _set(getattr(cfg, "is_encoder_decoder", False)) or _set(getattr(cfg, "add_cross_attention", False)):
        out.append("encoder-decoder / cross-attention models are not modelled")
    if _set(getattr(cfg, "kv_lora_rank", None)) or _set(getattr(cfg, "q_lora_rank", None)):
        out.append("MLA attention (kv_lora_rank / q_lora_rank) is not modelled")
    from earl_stream.model.moe_config import MOE_TYPES

    if (moe := [k for k in _MOE_KEYS if _set(getattr(cfg, k, None))]) and cfg.model_type not in MOE_TYPES:
        out.append(f"mixture-of-experts fields {moe} on model_type={cfg.model_type!r}: only the routed experts of "
                   f"{sorted(MOE_TYPES)} are modelled (the routers model.moe records and replays)")
    return out


def _decoder_layers(model: torch.nn.Module) -> tuple[str, int]:
    """(qualified name prefix, count) of the decoder layers: the longest ModuleList of same-class blocks."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
    if not lists:
        raise ConfigError(f"{type(model).__name__} holds no ModuleList of decoder layers: its structure cannot be read")
    name, layers = max(lists, key=lambda nm: len(nm[1]))
    return f"{name}.", len(layers)


def _leaf(name: str) -> str:
    """The module a parameter belongs to: `...q_proj.weight` -> q_proj (fused expert tensors keep their own)."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def _norms(layer: dict[str, tuple[int, ...]], hidden: int) -> tuple[int, int]:
    """(norms whose output feeds a linear, norms on a sub-layer's output) of hidden width in one layer.
    Llama calls its pre-MLP norm post_attention_layernorm; it is a post norm only beside a pre_* norm,
    or in a layer without an input norm (OLMo 2)."""
    names = {_leaf(n) for n, s in layer.items() if "norm" in _leaf(n) and n.endswith("weight") and s == (hidden,)}
    names -= {n for n in names if n.startswith(("q_", "k_"))}
    pre = {n for n in names if n.startswith(("input", "pre_"))}
    if "post_attention_layernorm" in names and "input_layernorm" in names and not any(n.startswith("pre_f") for n in names):
        pre.add("post_attention_layernorm")
    return len(pre), len(names - pre)


def read_structure(cfg: Any) -> dict[str, Any]:
    """`ModelShape`'s fields of the causal LM of transformers config `cfg` (see the module docstring)."""
    if problems := _refusals(cfg):
        raise ConfigError(f"memory model cannot use this model config (model_type={cfg.model_type!r}): "
                          + "; ".join(problems))
    model: Any = meta_model(cfg)
    tensors = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    vocab, hidden = (int(x) for x in embed.weight.shape)
    prefix, n_layers = _decoder_layers(model)
    layer0 = {n[len(prefix) + 2:]: s for n, s in tensors if n.startswith(prefix + "0.")}
    by_leaf = {_leaf(n) + ("." + n.rsplit(".", 1)[-1] if n.endswith(("weight", "bias")) else ""): s
               for n, s in layer0.items()}
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % kv:
        raise ConfigError(f"memory model cannot use this model config: num_attention_heads={heads} is not a multiple "
                          f"of num_key_value_heads={kv}")
    quirks = _quirks(cfg)
    fused_qkv = "qkv_proj.weight" in by_leaf
    if "q_proj.weight" in by_leaf:
        head_dim = by_leaf["q_proj.weight"][0] // heads
    elif fused_qkv:
        head_dim = by_leaf["qkv_proj.weight"][0] // (heads + 2 * kv)
    else:
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        quirks.append("attention without q_proj / qkv_proj: its activations are not modelled")
    is_moe = any(".experts." in n for n, _ in tensors)
    fused_gate_up = "gate_up_proj.weight" in by_leaf
    if "down_proj.weight" in by_leaf:
        inter = by_leaf["down_proj.weight"][1]
    else:
        inter = int(cfg.intermediate_size)
        if not is_moe:
            quirks.append("MLP without gate/up/down projections (not a gated MLP): its activations are not modelled")
    if not is_moe and not fused_gate_up and "gate_proj.weight" not in by_leaf and "down_proj.weight" in by_leaf:
        quirks.append("MLP without a gate projection (not a gated MLP): its activations are not modelled")
    pre, post = _norms(layer0, hidden)
    windowed, window = _windows(cfg, n_layers, quirks)
    return dict(
        model_type=str(cfg.model_type), hidden_size=hidden, num_layers=n_layers, num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
        tie_word_embeddings=head is not None and head.weight is embed.weight,
        qkv_bias="q_proj.bias" in by_leaf or "qkv_proj.bias" in by_leaf, o_bias="o_proj.bias" in by_leaf,
        mlp_bias="down_proj.bias" in by_leaf, qk_norm="q_norm.weight" in by_leaf, fused_qkv=fused_qkv,
        fused_gate_up=fused_gate_up, pre_norms=pre, post_norms=post, sliding_window=window,
        sliding_layers=windowed, tensors=tensors, layer_prefix=prefix, quirks=tuple(quirks), moe=is_moe,
        tp_problems=_problems(cfg, tp=2), sp_problems=_problems(cfg, sp=2))


def _windows(cfg: Any, n_layers: int, quirks: list[str]) -> tuple[int, int]:
    """(layers with a sliding window, the window) from `layer_types` (Gemma 3, Qwen2) or, without it,
    a `sliding_window` every layer applies (Mistral)."""
    window = int(getattr(cfg, "sliding_window", None) or 0)
    if (own := _fields(cfg)) and "sliding_window" not in own:
        window = 0  # a key the family does not define: its layers do not read it
    types = list(getattr(cfg, "layer_types", None) or ())
    if other := sorted(set(types) - {_WINDOWED, _FULL}):
        quirks.append(f"layer_types {other}: only full and sliding-window attention are modelled")
    if types:
        return (sum(t == _WINDOWED for t in types), window) if window else (0, 0)
    if window and getattr(cfg, "use_sliding_window", True) is not False:
        return n_layers, window
    return 0, 0


def _fields(cfg: Any) -> set[str]:
    """The fields the config class defines (transformers 5 configs are dataclasses); empty if unknown."""
    if dataclasses.is_dataclass(cfg):
        return {f.name for f in dataclasses.fields(cfg)}
    try:
        return set(type(cfg)().to_dict())
    except (TypeError, ValueError):
        return set()


def _quirks(cfg: Any) -> list[str]:
    """Config fields set that the memory model does not interpret (each its own `key=value`)."""
    from transformers import PretrainedConfig

    generic = set(PretrainedConfig().to_dict())
    own = _fields(cfg)
    out = []
    for key, value in sorted(cfg.to_dict().items()):
        if key in generic and key not in ("is_encoder_decoder", "add_cross_attention"):
            continue
        if key in _INTERPRETED:
            continue
        if own and key not in own:  # its modelling code may still getattr it: a quirk
            if _set(value):
                out.append(f"{key}={value!r} (not a field of {type(cfg).__name__})")
            continue
        if re.search("dropout|pdrop", key):
            if isinstance(value, (int, float)) and value > 0:
                out.append(f"{key}={value} (dropout masks)")
        elif _set(value) and not isinstance(value, dict):
            out.append(f"{key}={value!r}")
    return out


def _problems(cfg: Any, *, tp: int = 1, sp: int = 1) -> tuple[str, ...]:
    """Why the trainer cannot lay this family out under tp / sp (`workers.tensor_parallel.family_problems`),
    without the degree (`ModelShape.layout_problems` names it)."""
    from earl_stream.workers.tensor_parallel import family_problems

    return tuple(re.sub(r"^(tp|sp)=\d+: ", "", p) for p in family_problems(cfg, tp=tp, sp=sp))
