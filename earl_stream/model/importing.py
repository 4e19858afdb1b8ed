"""Importing a model into a standard Hugging Face directory: from a GGUF file or another HF directory.

This module owns `import_model` (what `earl-stream model import SRC OUT_DIR` runs): it reads SRC,
de-quantises a GGUF into float32, and writes OUT_DIR with safetensors weights, config, generation
config, tokenizer and chat template, which `model.path=OUT_DIR` then loads like any other model.
Any GGUF of a causal LM that transformers can read is accepted (it needs the optional `gguf` and
`accelerate` packages: `pip install 'earl_stream[real-model]'`), and what transformers' GGUF reader drops is
put back so that the import computes what llama.cpp computes from the file: Qwen3's head_dim, Qwen3-MoE's
expert width, Gemma 3's query scale, Llama 3's rope scaling (the `rope_freqs` tensor), and a Mistral
(stored as "llama") read by tensor names gguf-py knows. One clear `ModelError` per bad input: a GGUF of
an architecture transformers cannot load or that is not a causal LM, a source without a tokenizer or
chat template, a model too large for the memory at hand. The output is written next to OUT_DIR and
renamed into place, so a failed import leaves nothing half-written. Loading is `loading`'s job.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from earl_stream.errors import ModelError
from earl_stream.model.loading import check_model_dir, count_parameters, load_model, one_line
from earl_stream.progress import Report

__all__ = ["ImportReport", "available_memory_bytes", "import_model", "supported_gguf_architectures"]

logger = logging.getLogger(__name__)

# Peak bytes per parameter of a float32 import: the de-quantised model plus the plain copy that is saved.
_IMPORT_BYTES_PER_PARAM = 8
_STAGES = 3  # read, write, check the round trip (what `progress` counts)
_EXTRA_HINT = "pip install 'earl_stream[real-model]' (the gguf and accelerate packages)"


@dataclass(frozen=True)
class ImportReport:
    """What `import_model` wrote: source (path) and its format ("gguf" or "hf"), out_dir, the
    config's model_type, parameters (count), vocab_size (tokenizer entries), seconds (wall time)."""

    source: str
    source_format: str
    out_dir: str
    model_type: str
    parameters: int
    vocab_size: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON-able dict."""
        return asdict(self)


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def import_model(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False,
                 chat_template: str | None = None, memory_budget_bytes: int | None = None,
                 progress: Report | None = None) -> ImportReport:
    """Write the model at `src` (a .gguf file or an HF directory) to `out_dir` as a float32 HF directory.

    `chat_template` (Jinja text) replaces or supplies the tokenizer's; without one the source must
    carry its own. `memory_budget_bytes` bounds the import's peak memory (default: this machine's
    available memory). An existing non-empty `out_dir` is replaced only with `overwrite`. `progress` gets
    each of the import's stages (read, write, check that it loads back) as it starts, and the end.
    """
    stage = progress or (lambda done, total, note: None)
    started = time.monotonic()
    source = Path(src).expanduser()
    out = Path(out_dir).expanduser()
    if not source.exists():
        raise ModelError(f"model source {source} does not exist (give a .gguf file or a Hugging Face model directory)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ModelError(f"{out} already exists and is not empty; pass --overwrite to replace it")
    budget = memory_budget_bytes if memory_budget_bytes is not None else available_memory_bytes()
    stage(0, _STAGES, f"reading {source.name}")
    if source.is_dir():
        fmt = "hf"
        model, tokenizer = _read_hf_dir(source, budget)
    else:
        fmt = "gguf"
        model, tokenizer = _read_gguf(source, budget)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        where = "tokenizer.chat_template metadata" if fmt == "gguf" else "chat template"
        raise ModelError(f"{source} has no {where}; earl_stream renders every turn with one: pass --chat-template "
                         "FILE (a Jinja template) to supply it")
    _write(model, tokenizer, out, overwrite, stage)
    stage(_STAGES, _STAGES, "written")
    result = ImportReport(source=str(source), source_format=fmt, out_dir=str(out), model_type=model.config.model_type,
                          parameters=count_parameters(model), vocab_size=len(tokenizer),
                          seconds=round(time.monotonic() - started, 1))
    (out / "earl_stream_model.json").write_text(json.dumps({"imported": result.as_dict()}, indent=2) + "\n")
    logger.info("imported %s (%s, %d parameters) into %s in %.1f s", source, result.model_type, result.parameters,
                out, result.seconds)
    return result


def _check_memory(source: Path, parameters: int, budget: int) -> None:
    needed = parameters * _IMPORT_BYTES_PER_PARAM
    if budget and needed > budget:
        raise ModelError(f"{source} has {parameters / 1e9:.2f}B parameters: importing it in float32 needs about "
                         f"{needed / 2**30:.1f} GiB of memory, but only {budget / 2**30:.1f} GiB are available")


def _read_hf_dir(source: Path, budget: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    p = check_model_dir(source)
    weights = list(p.glob("*.safetensors")) + list(p.glob("*.bin"))
    # a float32 file holds 4 bytes per parameter; a half-precision one 2 (then this errs on the safe side)
    _check_memory(source, sum(w.stat().st_size for w in weights) // 2, budget)
    return load_model(p, dtype=torch.float32)


# What transformers' legacy GGUF reader (modeling_gguf_pytorch_utils) reads, in the spelling of a file's
# general.architecture, plus the architectures of its newer reader (integrations.gguf).
_GGUF_ARCH_SPELLING = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss",
                       "minimax_m2": "minimax-m2"}
# Keys llama.cpp writes that transformers' GGUF reader drops (as of 5.19), per architecture: without them the
# model gets its config class's defaults (Qwen3's head_dim 128, Qwen3-MoE's expert width 768), and either does
# not fit the weights or computes other logits. Applied only where transformers did not set the field itself.
_DROPPED_KEYS = {"qwen3": {"attention.key_length": "head_dim"},
                 "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"}}


def supported_gguf_architectures() -> list[str]:
    """The general.architecture values of the causal LMs transformers can load from GGUF."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # "mistral" is not one: llama.cpp writes Mistrals as "llama", and gguf-py names no "mistral" tensors
    causal = {a for a in GGUF_SUPPORTED_ARCHITECTURES if a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and a != "mistral"}
    return sorted({_GGUF_ARCH_SPELLING.get(a, a) for a in causal} | set(GGUF_CONFIG_ARCHS))


@dataclass(frozen=True)
class _GgufHeader:
    arch: str
    parameters: int
    metadata: dict[str, Any]  # scalar key-value pairs (arrays, such as the vocabulary, left out)
    rope_freqs: list[float] | None  # llama.cpp's per-frequency rope divisors (Llama 3's scaling), [head_dim / 2]


def _gguf_header(source: Path) -> _GgufHeader:
    """general.architecture, the parameter count and the scalar metadata, without reading the weights."""
    try:
        from gguf import GGUFReader, GGUFValueType, dequantize
    except ImportError:
        raise ModelError(f"reading {source} needs the gguf package: {_EXTRA_HINT}") from None
    try:
        reader = GGUFReader(source)
        metadata = {k: f.contents() for k, f in reader.fields.items() if f.types and f.types[0] != GGUFValueType.ARRAY}
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        rope_freqs = None if freqs is None else [float(x) for x in dequantize(freqs.data, freqs.tensor_type).ravel()]
        return _GgufHeader(str(metadata["general.architecture"]), sum(int(t.n_elements) for t in reader.tensors),
                           metadata, rope_freqs)
    except KeyError:
        raise ModelError(f"{source} is a GGUF file without general.architecture") from None
    except Exception as exc:
        raise ModelError(f"{source} is not a readable GGUF file: {one_line(exc)}") from None


def _config_fixes(header: _GgufHeader, read: dict[str, Any], config: PretrainedConfig) -> dict[str, Any]:
    """Config fields the GGUF states (or llama.cpp derives) that transformers' reader left out of `read`."""
    fixes: dict[str, Any] = {}
    rope = getattr(config, "rope_parameters", None) or {}
    if header.rope_freqs and header.arch == "llama" and rope.get("rope_type", "default") == "default":
        # llama.cpp divides each rope frequency by rope_freqs[i] (how it stores Llama 3's scaling); transformers'
        # "longrope" with equal short and long factors and no attention scaling computes exactly that
        fixes["rope_parameters"] = {"rope_type": "longrope", "rope_theta": rope.get("rope_theta", 10000.0),
                                    "short_factor": header.rope_freqs, "long_factor": header.rope_freqs,
                                    "factor": 1.0, "attention_factor": 1.0,
                                    "original_max_position_embeddings": config.max_position_embeddings}
    return fixes | _config_ints(header, read)


def _config_ints(header: _GgufHeader, read: dict[str, Any]) -> dict[str, int]:
    """The integer fields of `_config_fixes`: dropped keys, and Gemma 3's query scale as llama.cpp derives it."""
    arch, meta = header.arch, header.metadata
    fixes = {field: meta[f"{arch}.{key}"] for key, field in _DROPPED_KEYS.get(arch, {}).items()
             if f"{arch}.{key}" in meta and field not in read}
    if arch == "gemma3" and "query_pre_attn_scalar" not in read:
        # llama.cpp scales queries by 1/sqrt(head_dim), except for the 62-layer 27B: 1/sqrt(hidden / heads)
        hidden, heads, layers = (meta.get(f"gemma3.{k}") for k in ("embedding_length", "attention.head_count",
                                                                    "block_count"))
        head_dim = meta.get("gemma3.attention.key_length")
        fixes["query_pre_attn_scalar"] = hidden // heads if layers == 62 and hidden and heads else head_dim
    return {k: int(v) for k, v in fixes.items() if v is not None}


def _read_gguf(source: Path, budget: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise ModelError(f"loading {source} needs the accelerate package: {_EXTRA_HINT}")
    header = _gguf_header(source)
    supported = supported_gguf_architectures()
    if header.arch not in supported:
        raise ModelError(f"{source} holds a {header.arch!r} model, which transformers cannot load from GGUF; it "
                         f"loads these architectures: {', '.join(supported)}")
    try:
        read = load_gguf_checkpoint(str(source), return_tensors=False)["config"]
    except Exception as exc:
        raise ModelError(f"{source} holds a {header.arch!r} model, which transformers cannot load from GGUF "
                         f"({one_line(exc)})") from None
    model_type = str(read.get("model_type", header.arch))
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"{source} holds a {header.arch!r} model (model_type {model_type!r}), which is not a causal "
                         "language model")
    _check_memory(source, header.parameters, budget)
    folder, name = str(source.parent), source.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot build a tokenizer from {source}: {one_line(exc)}") from None
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
        for field, value in _config_fixes(header, read, config).items():
            logger.info("%s: %s = %s (from the GGUF data transformers does not read)", source, field, value)
            setattr(config, field, value)
        if header.metadata.get(f"{header.arch}.rope.scaling.type", "none") != "none":
            logger.warning("%s states rope scaling %r, which transformers' GGUF reader ignores: the imported model "
                           "computes other logits than llama.cpp's", source,
                           header.metadata[f"{header.arch}.rope.scaling.type"])
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=_load_config(header, config),
                                                         dtype=torch.float32, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot load the weights of {source}: {one_line(exc)}") from None
    return _plain_copy(source, quantized, config), _plain_tokenizer(header, tokenizer)


def _load_config(header: _GgufHeader, config: PretrainedConfig) -> PretrainedConfig:
    """The config to read the weights with. transformers reads a "llama" GGUF named "mistral" as a Mistral, then
    looks the tensor names up under gguf-py's architecture "mistral", which gguf-py does not have: llama.cpp
    wrote them as a Llama's, so they are read as one (same parameters) and then given the Mistral config."""
    if header.arch == "llama" and config.model_type == "mistral":
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        return LlamaConfig(**fields)
    return config


def _plain_tokenizer(header: _GgufHeader, tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """A byte-level BPE vocabulary (tokenizer.ggml.model "gpt2") in a Gemma GGUF comes back in a GemmaTokenizer,
    whose saved form reloads as a sentencepiece tokenizer without its <unk>: keep it a plain fast tokenizer."""
    if header.metadata.get("tokenizer.ggml.model") != "gpt2" or not type(tokenizer).__name__.startswith("Gemma"):
        return tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, bos_token=tokenizer.bos_token,
                                   eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token,
                                   unk_token=tokenizer.unk_token, chat_template=tokenizer.chat_template)


def _plain_copy(source: Path, loaded: PreTrainedModel, config: PretrainedConfig) -> PreTrainedModel:
    """The same weights in a model of `config` without the GGUF quantization config, which save_pretrained
    refuses."""
    # Drop the GGUF quantization config (save_pretrained refuses it) and what the GGUF reader added that the
    # config class does not define (general.name as `_model_name_or_path`, `unk_token_id`): labels, not
    # model properties, which consumers of config.json (the supervisor's memory model) would not know.
    extras = set(config.to_dict()) - set(type(config)().to_dict())
    for attr in {"quantization_config", *extras}:
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ModelError(f"the weights read from {source} do not fit a {type(plain).__name__}: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    plain.generation_config = loaded.generation_config
    plain.eval()
    return plain


def _write(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, overwrite: bool,
           stage: Report) -> None:
    """Save into a sibling temporary directory, check it loads back, then rename it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        stage(1, _STAGES, "writing safetensors")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stage(2, _STAGES, "checking that it loads back")
        _check_round_trip(model, tokenizer, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700, safetensors writes 0600: the imported model is meant to be shared
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            if not overwrite and (not out.is_dir() or any(out.iterdir())):  # it appeared meanwhile
                raise ModelError(f"{out} already exists and is not empty; pass --overwrite to replace it")
            old = out.parent / f".{out.name}.replaced-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_round_trip(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, saved: Path) -> None:
    """The saved directory loads back to the same tokens and the same logits (a short chat)."""
    loaded, loaded_tok = load_model(saved)
    chat = [{"role": "user", "content": "What is 12 + 30? Answer: 42."}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if loaded_tok.encode(text, add_special_tokens=False) != ids:
        raise ModelError(f"the tokenizer saved in {saved} tokenizes differently from the source's")
    with torch.no_grad():
        batch = torch.tensor([ids])
        mine, theirs = loaded(input_ids=batch).logits.float(), model(input_ids=batch).logits.float()
    # relative to the logits' scale: fp32 kernels that sum in another order (e.g. another attention
    # implementation) differ by ~1e-4 of it over a 30-layer model (SmolLM2: 3.9e-3 on logits of ~30)
    diff, scale = (mine - theirs).abs().max().item(), max(1.0, theirs.abs().max().item())
    if diff > 1e-3 * scale or not torch.equal(mine.argmax(-1), theirs.argmax(-1)):
        raise ModelError(f"the model saved in {saved} computes different logits from the source's (max diff "
                         f"{diff:.2e} on logits up to {scale:.1f})")
