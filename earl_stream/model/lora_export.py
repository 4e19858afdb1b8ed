"""LoRA adapters on disk: what a checkpoint of a LoRA run holds.

Owns the adapter side of a trainer checkpoint (`workers.checkpoint` calls these): its DCP state holds
the adapter tensors and their optimizer state only (the frozen base is referenced by path, never
copied; `checkpoint_model_state`), its side file records the adapter shape, and a resume with another
shape is refused naming what differs (`check_resumed_shape`); instead of a whole Hugging Face export
it holds `adapter/`, a PEFT adapter directory (`adapter_model.safetensors` + `adapter_config.json`,
whose `base_model_name_or_path` is the base's directory; `write_adapter_dir`). `earl-stream model export`
(`earl_stream.model.export`) turns a run's latest checkpoint into that adapter directory or, with merge, a whole
model directory that `transformers` (and vLLM) load as is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from earl_stream.errors import ModelError
from earl_stream.model.lora import LoraSpec, is_adapter_name, lora_spec, wire_name

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # how PEFT names a causal LM's tensors in a saved adapter


def checkpoint_model_state(model: torch.nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """The part of a model state dict a checkpoint holds: all of it, or a LoRA model's adapters alone."""
    if lora_spec(model) is None:
        return model_sd
    return {k: v for k, v in model_sd.items() if is_adapter_name(k)}


def side_info(model: torch.nn.Module) -> dict[str, Any]:
    """What the checkpoint's side file records about adapters ({} for a plain model)."""
    spec = lora_spec(model)
    if spec is None:
        return {}
    return {"lora": spec.to_dict(), "base_model": str(getattr(model, "name_or_path", ""))}


def check_resumed_shape(ckpt: Path, raw: dict[str, Any], model: torch.nn.Module) -> None:
    """ModelError naming what differs when the checkpoint's adapters (or their absence) are not the model's."""
    mine, saved = lora_spec(model), raw.get("lora")
    if mine is None and saved is None:
        return
    if mine is None or saved is None:
        raise ModelError(f"{ckpt} was written by a {'LoRA' if saved else 'full fine-tuning'} run and this run "
                         f"{'trains LoRA adapters' if mine else 'has model.lora.enabled=false'}: set model.lora as "
                         "the run that wrote it had it, or start a new run_dir")
    theirs = LoraSpec(rank=int(saved["rank"]), alpha=float(saved["alpha"]), dropout=float(saved.get("dropout", 0.0)),
                      target_modules=tuple(saved["target_modules"]))
    if diff := mine.differences(theirs):
        raise ModelError(f"{ckpt} holds adapters of another shape than model.lora ({'; '.join(diff)}; here = this "
                         "run's config, there = the checkpoint's): set model.lora like the run that wrote it, or "
                         "start a new run_dir")


def whole_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of `model` (peft's names), whole: a sharded one is gathered (collective over its
    mesh; every rank walks them in the same order)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in model.state_dict().items() if is_adapter_name(k)}


def write_adapter_dir(out: Path, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> Path:
    """A PEFT adapter directory `out` from the adapter tensors of `state` (whole tensors, peft's names)."""
    from safetensors.torch import save_file

    spec = lora_spec(model)
    if spec is None:
        raise ModelError("write_adapter_dir: the model has no LoRA adapters")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {_PEFT_PREFIX + wire_name(k): v.detach().to("cpu").contiguous() for k, v in state.items()
               if is_adapter_name(k)}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = spec.peft_config()
    config.base_model_name_or_path = str(getattr(model, "name_or_path", ""))
    config.save_pretrained(str(out))
    return out
