"""The tiny, fully offline mixture-of-experts models of tests and benchmarks.

Owns `init_moe_model`: a small Qwen3-MoE or Mixtral causal LM (a few experts, top-k routing) with the
tokenizer of `model.tiny`, written with `save_pretrained` so that everything loads it through the
same `from_pretrained(dir)` path as a user's model. What routing is, and how it is recorded and
replayed, is `model.moe`'s.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from earl_stream.errors import ModelError
from earl_stream.model.tiny import END, _train_tokenizer

__all__ = ["MOE_FAMILIES", "init_moe_model"]
logger = logging.getLogger(__name__)
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def init_moe_model(out_dir: str | os.PathLike[str], *, family: str = "qwen3_moe", hidden_size: int = 64,
                   num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, experts: int = 4, top_k: int = 2,
                   expert_size: int = 96, vocab_size: int = 512, seed: int = 0,
                   initializer_range: float = 0.1) -> Path:
    """Write a randomly initialised MoE causal LM of `family` (qwen3_moe or mixtral) with `experts`
    experts per layer, `top_k` routed per token, and the tiny model's tokenizer; return the path.
    float32, untied embeddings; the same arguments give the same bytes."""
    if family not in MOE_FAMILIES:
        raise ModelError(f"family={family!r} is not one of {MOE_FAMILIES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                  tie_word_embeddings=False, initializer_range=initializer_range, num_experts_per_tok=top_k,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, dtype="float32", output_router_logits=False)
    torch.manual_seed(seed)
    model: PreTrainedModel
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=expert_size,
                                                   intermediate_size=expert_size, norm_topk_prob=True,
                                                   head_dim=hidden_size // num_heads, **common))  # type: ignore[call-arg]
    else:
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=experts, intermediate_size=expert_size,
                                                 head_dim=hidden_size // num_heads, **common))
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(END), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("initialised %s (%d params, %d experts top-%d) in %s", type(model).__name__, model.num_parameters(),
                experts, top_k, out)
    return out
