"""Loading a Hugging Face causal-LM directory, with one clear error per thing that is wrong.

This module owns what makes a directory usable as `model.path`: a config of a causal LM, a tokenizer
with a chat template (the agent loop renders every turn through it), and readable weights. It reads
local directories only (`local_files_only`): a Hub id (`org/name`) is first turned into this host's
snapshot directory by `earl_stream.model.hub`, the one module that may reach the Hub. Writing such a
directory from a GGUF file or another directory is `earl_stream.model.importing`'s job.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from earl_stream.errors import ModelError
from earl_stream.model.mrope import MROPE_TYPES, MropeProcessor

__all__ = ["TOKENIZER_FILES", "VISION_POLICY_TYPES", "VISION_TRAIN_TYPES", "Policy", "check_model_dir", "check_vision_policy",
           "count_parameters", "is_vision_dir", "load_model", "load_policy", "load_processor", "load_tokenizer",
           "load_vision_model", "one_line", "placeholder_token_ids", "torch_dtype"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name ("fp32" or "bf16")."""
    if name not in _DTYPES:
        raise ModelError(f"unknown dtype {name!r}; known: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, so a ModelError stays one line however chatty the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:300]}"


def check_model_dir(path: str | os.PathLike[str], revision: str = "") -> Path:
    """`path` as a Path (`~` expanded) if it is an existing directory, or the snapshot directory of the Hub
    id `path` at `revision` (`model.hub.resolve`); else ModelError."""
    from earl_stream.model.hub import is_hub_id, resolve

    if is_hub_id(str(path)):
        return resolve(str(path), revision).path
    if revision:
        raise ModelError(f"model revision {revision!r} given for {path}, which is not a Hugging Face Hub id (org/name)")
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model directory {p} does not exist (create one with `earl-stream init-model DIR` or "
                         "`earl-stream model import SRC DIR`)")
    if not p.is_dir():
        raise ModelError(f"model path {p} is not a directory")
    return p


def load_tokenizer(path: str | os.PathLike[str], *, require_chat_template: bool = True,
                   revision: str = "") -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in the local directory `path`, or of the Hub id `path` at `revision`.

    With `require_chat_template` (the default: every role renders chats), a tokenizer without a chat
    template (in tokenizer_config.json or chat_template.jinja) is a ModelError naming the directory.
    A missing pad token becomes the eos token.
    """
    p = check_model_dir(path, revision)
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(f"model directory {p} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer in {p}: {one_line(exc)}") from None
    if require_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"the tokenizer in {p} has no chat template (neither chat_template.jinja nor a "
                         "chat_template entry in tokenizer_config.json); earl_stream renders every turn with it")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _config(p: Path) -> Any:
    """The model config in directory `p` (ModelError, one line, where it cannot be read)."""
    try:
        return AutoConfig.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot read {p / 'config.json'}: {one_line(exc)}") from None


def load_model(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, revision: str = ""
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the causal LM and tokenizer in the local directory `path` (or of the Hub id `path` at
    `revision`: this host's snapshot, downloaded if online), model in eval mode.

    Raises ModelError (one line) for a missing directory, a directory without config.json, a
    config that is not a causal LM, a missing tokenizer or chat template, or unreadable weights.
    """
    p = check_model_dir(path, revision)
    if not (p / "config.json").is_file():
        raise ModelError(f"model directory {p} has no config.json; it is not a Hugging Face model directory")
    config = _config(p)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            raise ModelError(f"model in {p} is a vision-language model ({config.model_type}): load it with "
                             "earl_stream.model.load_vision_model (or load_policy)")
        raise ModelError(
            f"model in {p} has model_type {config.model_type!r}, which is not a causal language model"
        )
    tokenizer = load_tokenizer(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype)
    except Exception as exc:
        raise ModelError(f"cannot load the model weights in {p}: {one_line(exc)}") from None
    model.eval()
    return model, tokenizer


VISION_POLICY_TYPES: tuple[str, ...] = ("idefics3", "smolvlm")  # vision-language families every engine runs
VISION_TRAIN_TYPES: tuple[str, ...] = (*VISION_POLICY_TYPES, *MROPE_TYPES)  # the trainer, SFT and the built-in engine
_LATER_MROPE_TYPES = ("qwen3_vl", "qwen3_vl_moe")  # 3-D positions interleaved, and features fed to several layers


def check_vision_policy(model_type: str, *, engine: str | None = None) -> None:
    """Refuse (ModelError, one line) a vision-language family earl_stream cannot run: as a model the trainer and
    `earl-stream sft` train (`engine` None: `VISION_TRAIN_TYPES`), or as the policy of a run whose rollout workers
    use `engine` (the built-in "torch" engine: the same; vLLM and SGLang: `VISION_POLICY_TYPES`, they are not given
    the 3-D positions of the Qwen2-VL family here). Other multimodal checkpoints (Gemma 3 4B+) run as text models."""
    if model_type in _LATER_MROPE_TYPES:
        raise ModelError(f"model_type {model_type!r} is a vision-language model earl_stream does not run yet: its "
                         "decoder takes interleaved 3-D (multimodal RoPE) positions and image features in several "
                         f"layers; the vision-language families it runs: {', '.join(VISION_TRAIN_TYPES)}")
    if engine not in (None, "torch") and model_type in MROPE_TYPES:
        raise ModelError(f"model_type {model_type!r} is a vision-language model earl_stream runs with "
                         f"rollout.engine=torch only: its decoder takes 3-D (multimodal RoPE) positions, which the "
                         f"{engine} engine is not given here; with {engine}, the families it runs: "
                         f"{', '.join(VISION_POLICY_TYPES)} (e.g. model.path=default:tictactoe_image)")


def load_processor(path: str | os.PathLike[str], *, revision: str = "") -> Any:
    """The processor (`AutoProcessor`: the tokenizer with its chat template, and the image processor) of the
    vision-language model in `path`, which earl_stream runs as a policy; ModelError (one line) otherwise. What a
    rollout worker whose engine loads the weights itself (vLLM) renders turns with."""
    p = check_model_dir(path, revision)
    config = _config(p)
    if config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise ModelError(f"model in {p} has model_type {config.model_type!r}, which is not a vision-language model")
    check_vision_policy(config.model_type)
    if config.model_type in MROPE_TYPES:  # the tokenizer and the image processor (see model.mrope)
        try:
            images = AutoImageProcessor.from_pretrained(p, local_files_only=True)
        except Exception as exc:
            raise ModelError(f"cannot load the image processor in {p}: {one_line(exc)}") from None
        return MropeProcessor(load_tokenizer(p), images)
    try:
        processor = AutoProcessor.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot load the processor in {p}: {one_line(exc)}") from None
    if not getattr(processor, "chat_template", None) and not getattr(processor.tokenizer, "chat_template", None):
        raise ModelError(f"the processor in {p} has no chat template; earl_stream renders every turn with it")
    return processor


def load_vision_model(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
                      revision: str = "") -> tuple[PreTrainedModel, Any]:
    """Load the vision-language model (`AutoModelForImageTextToText`) and its processor (`AutoProcessor`: the
    tokenizer with its chat template, and the image processor) in `path`, model in eval mode. Raises ModelError
    (one line) for a directory that holds no such model or whose processor cannot load."""
    p = check_model_dir(path, revision)
    processor = load_processor(p)
    try:
        model = AutoModelForImageTextToText.from_pretrained(p, local_files_only=True, dtype=dtype)
    except Exception as exc:
        raise ModelError(f"cannot load the model weights in {p}: {one_line(exc)}") from None
    model.eval()
    return model, processor


def placeholder_token_ids(config: Any) -> tuple[int, ...]:
    """The token ids a vision-language model's forward replaces by image (or video) features (`image_token_id`,
    and Qwen2-VL's `video_token_id`; none for a text model). A policy never samples them: one in a reply would
    stand for a picture that is not there (the forward's merge fails on the count). The engine masks them out of
    sampling and the trainer out of its log-probs, so both see the same distribution."""
    if getattr(config, "vision_config", None) is None:
        return ()
    found = (getattr(config, name, None) for name in ("image_token_id", "video_token_id"))
    return tuple(int(t) for t in found if t is not None)


def is_vision_dir(path: str | os.PathLike[str]) -> bool:
    """Whether the model directory `path` holds a vision-language model (its config's type is image-text-to-text)."""
    p = Path(path)
    return (p / "config.json").is_file() and _config(p).model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


class Policy(NamedTuple):
    """A policy's model, tokenizer and, for a vision-language model, its processor (None for a causal LM)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    processor: Any = None


def load_policy(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, revision: str = "") -> Policy:
    """`load_vision_model` for a vision-language model's directory, else `load_model`: what the trainer and the
    rollout workers run as `model.path`."""
    p = check_model_dir(path, revision)
    if is_vision_dir(p):
        model, processor = load_vision_model(p, dtype=dtype)
        return Policy(model, processor.tokenizer, processor)
    return Policy(*load_model(p, dtype=dtype))


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters of `model` (all of them, trainable or not)."""
    return sum(p.numel() for p in model.parameters())
