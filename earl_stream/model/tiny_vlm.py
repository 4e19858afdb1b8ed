"""Tiny, fully offline vision-language models of the families users start from.

Owns `init_vlm_model`: a small randomly initialised image-text-to-text model with a real vision tower and the
real processor classes of its family, written with `save_pretrained` so that tests and benchmarks load it
through the same `AutoProcessor` / `AutoModelForImageTextToText.from_pretrained(dir)` path as a user's
checkpoint. The tokenizer is `model.tiny`'s byte-level BPE plus the family's image tokens; the chat template
renders content parts (`{"type": "image"}`, `{"type": "text"}`) in the tiny model's turn format.

Families:
- `idefics3` (SmolVLM's architecture: SmolVLM-256M/500M/2.2B-Instruct are Idefics3 checkpoints): a SigLIP
  vision tower, a pixel-shuffle connector and a Llama decoder; one image is resized to `image_size` and shown
  as `<fake_token_around_image><global-img>` + `image_seq_len` `<image>` tokens + `<fake_token_around_image>`
  (no tiling: `do_image_splitting` off, so a board picture is a fixed, small number of tokens).
- `qwen2_5_vl`: a windowed ViT with 2x2 patch merging and a Qwen2 decoder with multimodal (3-D) RoPE; an image
  is `<|vision_start|>` + one `<|image_pad|>` per merged patch + `<|vision_end|>`. Its processor class needs a
  video processor, which transformers builds only with torchvision installed: without it the model and the
  image processor are written, and `AutoProcessor` refuses to load the directory (as it would a user's);
  earl_stream reads the tokenizer and image processor (`model.mrope.MropeProcessor`).
- `qwen2_vl`: Qwen2-VL, the same layout with a ViT that attends over the whole image (LayerNorm, a GELU MLP).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers

from earl_stream.errors import ModelError
from earl_stream.model.tiny import END, _train_tokenizer

__all__ = ["VLM_CHAT_TEMPLATE", "VLM_FAMILIES", "init_vlm_model"]
logger = logging.getLogger(__name__)

VLM_FAMILIES: tuple[str, ...] = ("idefics3", "qwen2_5_vl", "qwen2_vl")

# The tiny model's turn format (`<|role|>\n...<|end|>\n`) over content parts; `{image}` is the family's
# placeholder that its processor expands into the image's tokens.
_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '{image}' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '{end}\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
# Idefics3's processor makes its own tokens the tokenizer's only extra special ones (at every load), so its turns
# end with one of them, `<end_of_utterance>`, as SmolVLM's do.
_END = {"idefics3": "<end_of_utterance>", "qwen2_5_vl": END, "qwen2_vl": END}
VLM_CHAT_TEMPLATE: dict[str, str] = {
    "idefics3": _TEMPLATE.replace("{image}", "<image>").replace("{end}", _END["idefics3"]),
    "qwen2_5_vl": _TEMPLATE.replace("{image}", "<|vision_start|><|image_pad|><|vision_end|>").replace("{end}", END),
}
VLM_CHAT_TEMPLATE["qwen2_vl"] = VLM_CHAT_TEMPLATE["qwen2_5_vl"]
_IMAGE_TOKENS = {
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
}
_IMAGE_TOKENS["qwen2_vl"] = _IMAGE_TOKENS["qwen2_5_vl"]


def _text_config(tokenizer: Any, hidden_size: int, num_layers: int, intermediate_size: int,
                 initializer_range: float) -> dict[str, Any]:
    return {"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": intermediate_size,
            "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "initializer_range": initializer_range,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def _idefics3(tokenizer: Any, text: dict[str, Any], image_size: int, vision_hidden: int) -> tuple[Any, Any, Any]:
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    patch, scale = 16, 2
    if image_size % (patch * scale):
        raise ModelError(f"image_size={image_size} must be a multiple of {patch * scale} for idefics3")
    config = transformers.Idefics3Config(
        text_config=text, scale_factor=scale, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_config={"hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": image_size, "patch_size": patch})
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                               image_seq_len=(image_size // patch) ** 2 // scale ** 2,
                                               chat_template=VLM_CHAT_TEMPLATE["idefics3"])
    return transformers.Idefics3ForConditionalGeneration(config), processor, images


def _qwen2_5_vl(tokenizer: Any, text: dict[str, Any], image_size: int, vision_hidden: int,
                qwen2: bool = False) -> tuple[Any, Any, Any]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _IMAGE_TOKENS["qwen2_5_vl"]}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # t, h, w: halves of the rotary dims
    text = {**text, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}}
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    common = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_heads": 2}
    if qwen2:  # Qwen2-VL: `embed_dim` is the tower's width, `hidden_size` the merger's output
        config: Any = transformers.Qwen2VLConfig(
            text_config=text, tie_word_embeddings=False, **tokens,
            vision_config={**common, "depth": 2, "embed_dim": vision_hidden, "mlp_ratio": 2,
                           "hidden_size": text["hidden_size"]})
    else:
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, tie_word_embeddings=False, **tokens,
            vision_config={**common, "depth": 2, "hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden,
                           "out_hidden_size": text["hidden_size"], "window_size": 56, "fullatt_block_indexes": [1]})
    pixels = image_size * image_size
    images = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=2 * pixels, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    kind = transformers.Qwen2VLProcessor if qwen2 else transformers.Qwen2_5_VLProcessor
    try:
        processor: Any = kind(image_processor=images, tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE["qwen2_5_vl"])
    except (AttributeError, ImportError, TypeError, ValueError) as exc:  # no video processor without torchvision
        logger.warning("%s cannot be built here (%s: %s); writing the image processor and tokenizer only",
                       kind.__name__, type(exc).__name__, exc)
        processor = None
    model = (transformers.Qwen2VLForConditionalGeneration if qwen2 else transformers.Qwen2_5_VLForConditionalGeneration)
    return model(config), processor, images


def _qwen2_vl(tokenizer: Any, text: dict[str, Any], image_size: int, vision_hidden: int) -> tuple[Any, Any, Any]:
    return _qwen2_5_vl(tokenizer, text, image_size, vision_hidden, qwen2=True)


_BUILDERS = {"idefics3": _idefics3, "qwen2_5_vl": _qwen2_5_vl, "qwen2_vl": _qwen2_vl}


def init_vlm_model(out_dir: str | os.PathLike[str], *, family: str = "idefics3", hidden_size: int = 64,
                   num_layers: int = 2, intermediate_size: int = 128, vision_hidden_size: int = 32,
                   image_size: int = 64, vocab_size: int = 512, seed: int = 0, initializer_range: float = 0.1) -> Path:
    """Write a randomly initialised vision-language model of `family` (one of VLM_FAMILIES), its tokenizer and its
    processor to `out_dir`; return the path. float32; the same arguments give the same bytes. `image_size`:
    the side every image is resized to (idefics3: 64 gives 4 image tokens per image; qwen2_5_vl, qwen2_vl: 56
    gives 4)."""
    if family not in _BUILDERS:
        raise ModelError(f"family={family!r} is not one of {VLM_FAMILIES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.add_tokens(_IMAGE_TOKENS[family], special_tokens=True)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE[family]
    text = _text_config(tokenizer, hidden_size, num_layers, intermediate_size, initializer_range)
    torch.manual_seed(seed)
    model, processor, images = _BUILDERS[family](tokenizer, text, image_size, vision_hidden_size)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(_END[family]), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    if processor is not None:
        processor.save_pretrained(out)
    else:
        tokenizer.save_pretrained(out)
        images.save_pretrained(out)
    logger.info("initialised %s (%d params) in %s", type(model).__name__, model.num_parameters(), out)
    return out
