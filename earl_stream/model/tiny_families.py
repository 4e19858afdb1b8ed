"""Tiny, fully offline dense models of the Hugging Face families users start from.

Owns `init_family_model`: a small randomly initialised causal LM of a named family (Llama 3, Qwen2.5,
Qwen3, Mistral, Gemma 3 text, Phi-3, SmolLM3, OLMo 2, Granite) with the tokenizer of `model.tiny`,
written with `save_pretrained`, so that tests and benchmarks load it through the same
`from_pretrained(dir)` path as a user's model. Each family keeps the quirks that make it itself
(Qwen3's and OLMo 2's q/k norms, Gemma 3's sliding-window layers and scaled embeddings, Phi-3's fused
projections, SmolLM3's layers without rotary embeddings, Granite's multipliers); only the sizes are
small. Mixtures of experts are `model.tiny_moe`'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from earl_stream.errors import ModelError
from earl_stream.model.tiny import END, _train_tokenizer

__all__ = ["FAMILIES", "init_family_model"]
logger = logging.getLogger(__name__)


def _layer_types(n: int, every: int) -> list[str]:
    """Gemma 3's pattern: sliding-window layers with a full-attention layer every `every` layers."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


# family -> (config class, model class, family-specific config fields given the layer count)
_SPECS: dict[str, tuple[str, str, Callable[[int], dict[str, Any]]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", lambda n: {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", lambda n: {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", lambda n: {"head_dim": 48}),  # head_dim != hidden / heads
    "mistral": ("MistralConfig", "MistralForCausalLM", lambda n: {"sliding_window": None}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", lambda n: {
        "head_dim": 32, "sliding_window": 16, "layer_types": _layer_types(n, 2), "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh"}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", lambda n: {"sliding_window": None}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", lambda n: {
        "no_rope_layers": [0 if (i + 1) % 2 == 0 else 1 for i in range(n)]}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", lambda n: {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", lambda n: {
        "embedding_multiplier": 4.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5, "logits_scaling": 2.0}),
}
FAMILIES: tuple[str, ...] = tuple(_SPECS)


def init_family_model(out_dir: str | os.PathLike[str], *, family: str, hidden_size: int = 64, num_layers: int = 2,
                      num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                      vocab_size: int = 512, tie_word_embeddings: bool = False, seed: int = 0,
                      initializer_range: float = 0.1) -> Path:
    """Write a randomly initialised causal LM of `family` (one of FAMILIES) with the tiny model's
    tokenizer to `out_dir`; return the path. float32; the same arguments give the same bytes."""
    if family not in _SPECS:
        raise ModelError(f"family={family!r} is not one of {FAMILIES}")
    config_cls, model_cls, extra = _SPECS[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    config = getattr(transformers, config_cls)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32", **extra(num_layers))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(END), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("initialised %s (%d params) in %s", type(model).__name__, model.num_parameters(), out)
    return out
