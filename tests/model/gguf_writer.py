"""Test helper: write a small Hugging Face causal LM as a float32 GGUF file the way llama.cpp's converter does.

Owns `write_gguf` and the per-family facts it needs (the llama.cpp architecture name, the q/k row
permutation of Llama-style rope, Llama 3's rope scaling as `rope_freqs`, Gemma's norms stored as 1 + w,
Qwen3-MoE's experts stored as one tensor per projection). Tensor names come from the `gguf` package's own
HF-to-GGUF name map, so the file is named as llama.cpp names it; reading it back is
`earl_stream.model.importing`'s job. The tokenizer is the tiny model's byte-level BPE, written as
`tokenizer.ggml.model = "gpt2"`.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel

from earl_stream.model import CHAT_TEMPLATE, load_tokenizer

__all__ = ["GGUF_ARCH", "write_gguf"]

# HF model_type -> llama.cpp architecture. llama.cpp writes Mistral (without sliding window) as "llama";
# transformers reads it back as Mistral only when general.name is exactly "mistral".
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2"}
_CONTROL, _NORMAL = 3, 1  # llama.cpp token types


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows of Llama-style rope interleaved per head; transformers undoes it on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tokenizer(w: gguf.GGUFWriter, tokenizer_dir: Path, chat_template: str | None) -> None:
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokenizer = load_tokenizer(tokenizer_dir)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the tiny tokenizer splits text with Qwen2's regex
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([_CONTROL if t in special else _NORMAL for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _write_hparams(w: gguf.GGUFWriter, model: PreTrainedModel) -> None:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' rope; llama.cpp fixes the local one
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if cfg.model_type == "qwen3_moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _tensors(model: PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array, transformed as llama.cpp's converter transforms them."""
    cfg = model.config
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    rope = cfg.rope_parameters
    if arch == "llama" and rope.get("rope_type") == "llama3":  # llama.cpp stores the scaling as frequency divisors
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        out["rope_freqs.weight"] = (plain / model.model.rotary_emb.inv_freq.double()).float().numpy()
    for hf, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        base, _, suffix = hf.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf, "weight"
        if base.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows first, then up rows
            gate, up = np.split(data, 2, axis=1)
            prefix = names.get_name(base.replace("gate_up_proj", "down_proj")).replace("down", "{}")
            out[prefix.format("gate") + ".weight"], out[prefix.format("up") + ".weight"] = gate, up
            continue
        name = names.get_name(base)
        assert name is not None, f"no GGUF name for {hf} in {arch}"
        if arch == "llama" and name.endswith(("attn_q", "attn_k")):
            data = _permute(data, cfg.num_attention_heads if name.endswith("q") else cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm"):
            data = data + 1.0  # Gemma scales by (1 + w); llama.cpp stores the sum
        out[f"{name}.{suffix}"] = np.ascontiguousarray(data, dtype=np.float32)
    return out


def write_gguf(path: Path, model: PreTrainedModel, tokenizer_dir: Path, *, arch: str | None = None,
               name: str | None = None, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Write `model` and the byte-level BPE tokenizer in `tokenizer_dir` to `path` as llama.cpp would.

    `arch` (default: the model's llama.cpp architecture) may name another one to test refusals; `name`
    is general.name (default "mistral" for a Mistral, as transformers needs, else "earl tiny <type>").
    """
    model_type = model.config.model_type
    real_arch = GGUF_ARCH[model_type]
    w = gguf.GGUFWriter(str(path), arch or real_arch)
    w.add_name(name or ("mistral" if model_type == "mistral" else f"earl tiny {model_type}"))
    _write_hparams(w, model)
    _write_tokenizer(w, tokenizer_dir, chat_template)
    for tensor_name, data in _tensors(model, real_arch).items():
        w.add_tensor(tensor_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
