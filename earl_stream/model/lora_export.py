"""LoRA adapters on disk: what a checkpoint of a LoRA run holds and `earl-stream model export`.

Owns the adapter side of a trainer checkpoint (`workers.checkpoint` calls these): its DCP state holds
the adapter tensors and their optimizer state only (the frozen base is referenced by path, never
copied; `checkpoint_model_state`), its side file records the adapter shape, and a resume with another
shape is refused naming what differs (`check_resumed_shape`); instead of a whole Hugging Face export
it holds `adapter/`, a PEFT adapter directory (`adapter_model.safetensors` + `adapter_config.json`,
whose `base_model_name_or_path` is the base's directory; `write_adapter_dir`). `export_model` turns a
run's latest checkpoint into that adapter directory or, with merge, a whole model directory that
`transformers` (and vLLM) load as is.
"""

from __future__ import annotations

import json
import logging
import shutil
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


def export_model(run_dir: str | Path, out: str | Path, *, merge: bool = False, base: str = "",
                 overwrite: bool = False) -> Path:
    """The latest checkpoint of `run_dir` as a PEFT adapter directory, or (merge) a whole Hugging Face
    model directory: base + alpha / r x B A in every adapted layer, plus the tokenizer. A full
    fine-tuning run's checkpoint is already a model directory: it is copied (merge or not)."""
    from earl_stream.workers.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ModelError(f"{run_dir} has no checkpoint (no checkpoints/latest)")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ModelError(f"{out} exists and is not empty (pass --overwrite to replace it)")
        shutil.rmtree(out)
    adapter = ckpt / ADAPTER_DIR
    if not adapter.is_dir():
        shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("dcp", "run_state.pt", "*.tmp"))
        log.info("%s is a full model checkpoint: copied its Hugging Face export to %s", ckpt, out)
        return out
    if not merge:
        shutil.copytree(adapter, out)
        return out
    return _merge(adapter, out, base or _base_of(adapter), ckpt)


def _base_of(adapter: Path) -> str:
    base = str(json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
    if not base or not Path(base).is_dir():
        raise ModelError(f"{adapter / ADAPTER_CONFIG} names the base model {base!r}, which is not a directory here: "
                         "pass --base DIR")
    return base


def _merge(adapter: Path, out: Path, base: str, ckpt: Path) -> Path:
    from peft import PeftModel

    from earl_stream.model.loading import load_model, load_tokenizer

    model, _ = load_model(base)
    merged: Any = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(out))
    tokenizer_dir = ckpt if (ckpt / "tokenizer_config.json").exists() else Path(base)
    load_tokenizer(str(tokenizer_dir)).save_pretrained(str(out))
    log.info("merged the adapter of %s into %s: %s", ckpt, base, out)
    return out
