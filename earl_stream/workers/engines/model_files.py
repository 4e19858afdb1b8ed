"""What the out-of-process backends (vLLM, SGLang) share about a model directory and their weight files.

Owns `ModelShape` / `read_model_shape` (a model directory's config and tensor shapes, no weights read),
`state_problems` (whether a whole state fits it), `write_checkpoint` (a state as a safetensors model
directory for a backend to reload), `shm_root` (a private directory in RAM for those) and
`clamp_capacity` (what a backend sized at start-up can take).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from earl_stream.errors import EngineError
from earl_stream.workers.engines.base import EngineCapacity

_LOG = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the backends need to know about a model directory without loading its weights."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    tied_embeddings: bool
    tensors: dict[str, tuple[int, ...]]  # checkpoint tensor name -> shape (empty if not safetensors)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of KV cache one token takes: keys and values of every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _DTYPE_BYTES.get(dtype, 4)


def read_model_shape(model_dir: Path) -> ModelShape:
    """Read config.json and the safetensors headers of `model_dir` (no weights are loaded)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise EngineError(f"{model_dir} has no config.json; it is not a Hugging Face model directory")
    full = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    config = full.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    tensors: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = tuple(handle.get_slice(name).get_shape())
    return ModelShape(
        vocab_size=int(config.vocab_size),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        max_positions=int(getattr(config, "max_position_embeddings", 4096)),
        tied_embeddings=bool(getattr(full, "tie_word_embeddings", False)),
        tensors=tensors,
    )


def state_problems(state: Mapping[str, torch.Tensor], shape: ModelShape) -> list[str]:
    """Every reason `state` does not match the checkpoint's tensors (empty if it does or is unknown)."""
    if not shape.tensors:
        return []
    problems = []
    own = shape.tensors
    # A tied output head is absent from the checkpoint but present in a trainer's state_dict.
    unknown = sorted(n for n in state if n not in own and not (shape.tied_embeddings and n == "lm_head.weight"))
    missing = sorted(n for n in own if n not in state)
    if unknown:
        problems.append(f"unknown names {unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
    if missing:
        problems.append(f"missing names {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name} is a {type(tensor).__name__}, not a tensor")
        elif name in own and tuple(tensor.shape) != own[name]:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the model has {own[name]}")
    return problems


def write_checkpoint(state: Mapping[str, torch.Tensor], out_dir: Path, config: dict[str, Any]) -> Path:
    """Write `state` as out_dir/model.safetensors plus out_dir/config.json; return out_dir."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # safetensors refuses aliased tensors (tied weights)
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


_SHM_PREFIX = "earl-vllm-"


def shm_root() -> Path:
    """A fresh private directory in RAM (/dev/shm) if there is one, else in the temp directory, named by
    this process's pid; the ones left by processes that died without cleaning up (a kill -9 skips every
    finaliser) are removed first, so that RAM does not fill with old weight versions."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    sweep_dead_roots(base)
    return Path(tempfile.mkdtemp(prefix=f"{_SHM_PREFIX}{os.getpid()}-", dir=base))


def sweep_dead_roots(base: Path) -> list[Path]:
    """Remove the `shm_root` directories under `base` whose owner process is gone (returns them)."""
    gone = []
    for d in base.glob(f"{_SHM_PREFIX}*-*"):
        owner = d.name[len(_SHM_PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or _alive(int(owner)) or not d.is_dir():
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    if gone:
        _LOG.info("removed %d weight directories left by dead processes under %s", len(gone), base)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True



def clamp_capacity(requested: EngineCapacity, started: EngineCapacity, engine: str) -> EngineCapacity:
    """The capacity an engine sized at start-up can take: lower values as asked, higher ones clamped."""
    if requested.max_concurrent_sequences < 1 or requested.kv_budget_tokens < 1:
        raise EngineError(f"invalid engine capacity {requested}: both values must be >= 1")
    clamped = EngineCapacity(min(requested.max_concurrent_sequences, started.max_concurrent_sequences),
                             min(requested.kv_budget_tokens, started.kv_budget_tokens))
    if clamped != requested:
        _LOG.warning("%s sizes its scheduler and KV cache at start (%s); %s clamped to %s", engine, started,
                     requested, clamped)
    return clamped
