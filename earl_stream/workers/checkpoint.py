"""Trainer checkpoints: layout-independent, written with torch.distributed.checkpoint (DCP).

Owns the on-disk format of `run_dir/checkpoints/` and the code that writes and reads it; the trainer
loop (`workers.trainer`) decides when. A checkpoint is a directory `step_NNNNNN/` holding

- `dcp/`: model and optimizer state in DCP format, keyed by parameter names (FQNs) from
  `torch.distributed.checkpoint.state_dict.get_state_dict`, so it does not depend on the pool's
  layout. Every rank of the pool saves collectively (each rank writes the items DCP assigns it;
  replicated tensors are written once), and a pool of any size loads it (DCP reshards from the
  metadata; with full replicas every rank reads every tensor);
- `run_state.pt`: the small side file rank 0 writes: step, policy version, rank 0's CPU RNG state,
  the (step, lost sample ids) releases still owed to the supervisor, and the pool size that wrote it;
- a Hugging Face export of the model and tokenizer (rank 0), so `model.path=<checkpoint dir>`
  evaluates or warm-starts from it with nothing but transformers. A LoRA run (`model.lora`) holds only
  its adapters and their optimizer state in `dcp/` (the frozen base is referenced, never copied) and
  a PEFT adapter directory `adapter/` instead of the whole model (`model.lora_export`).

`checkpoints/latest` names the newest complete checkpoint; it is replaced atomically only after DCP's
metadata and the side file are on disk, so a pool killed mid-save resumes from the previous one.

The format written before DCP (`trainer_state.pt` with a whole `optimizer.state_dict()` next to the
HF export) is still read, so an older run resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from earl_stream.errors import ModelError
from earl_stream.model.lora import lora_spec
from earl_stream.model.lora_export import (
    ADAPTER_DIR,
    check_resumed_shape,
    checkpoint_model_state,
    side_info,
    whole_adapters,
    write_adapter_dir,
)
from earl_stream.workers.packed_attention import strip_run_state

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
DCP_DIR = "dcp"
RUN_STATE = "run_state.pt"
LEGACY_STATE = "trainer_state.pt"  # the format before DCP: rank 0's torch.save of everything


@dataclasses.dataclass
class RunState:
    """What a checkpoint holds besides tensors sharded by DCP.

    `rng` is rank 0's `torch.get_rng_state()` (uint8 [N]); `unreleased` lists (step, lost sample
    ids) trained steps whose release the supervisor had not been sent when the checkpoint was written.
    """

    step: int
    policy_version: int
    rng: torch.Tensor
    unreleased: list[tuple[int, list[str]]]
    world_size: int = 1
    format: int = FORMAT_VERSION


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint `checkpoints/latest` names, or None when the run has none."""
    latest = checkpoints_dir(run_dir) / "latest"
    if not latest.exists():
        return None
    ckpt = latest.parent / latest.read_text().strip()
    if not ckpt.is_dir():
        raise ModelError(f"{latest} names {ckpt.name}, which does not exist; point it at one of "
                         f"{sorted(p.name for p in latest.parent.glob('step_*'))} or delete it to start afresh")
    return ckpt


def save_checkpoint(run_dir: str | os.PathLike[str], state: RunState, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, tokenizer: Any = None, *, rank: int = 0,
                    collective: bool = True) -> Path:
    """Write `checkpoints/step_{state.step:06d}` and point `latest` at it; returns its directory.

    `tokenizer`: what the model's directory needs beside its weights (a tokenizer, or a vision-language policy's
    processor: anything with `save_pretrained`); rank 0 writes it with a whole-model export (None: none).
    collective=True: every rank of the default process group calls this at the same step (it runs
    DCP's collectives). collective=False: rank 0 alone, e.g. when the pool stops and the ranks may not
    agree on the step; valid only while every rank holds a full replica of model and optimizer
    (data and sequence parallel), since rank 0 then writes all of it.
    """
    out = checkpoints_dir(run_dir) / f"step_{state.step:06d}"
    out.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd = checkpoint_model_state(model, model_sd)  # a LoRA run: its adapters (the base is referenced)
    no_dist = not collective or not dist.is_initialized()
    with _quiet(no_dist):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / DCP_DIR, no_dist=no_dist)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    lora = lora_spec(model) is not None
    # the Hugging Face export needs whole tensors: gathered from the shards (collective), kept on rank 0
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if sharded and tokenizer is not None and not lora else None
    adapters = whole_adapters(model) if lora else {}  # collective too: every rank gathers them in order
    if rank != 0:
        return out
    if lora:  # a PEFT adapter directory instead of a whole model
        write_adapter_dir(out / ADAPTER_DIR, model, adapters)
    if tokenizer is not None:
        if not lora:
            strip_run_state(model)  # config.json holds the model's own fields, not packed attention's note
            model.save_pretrained(out, state_dict=full)  # type: ignore[operator]
        tokenizer.save_pretrained(out)
    _atomic_torch_save({**dataclasses.asdict(state), **side_info(model)}, out / RUN_STATE)
    latest = checkpoints_dir(run_dir) / "latest"
    tmp = latest.with_suffix(".tmp")
    tmp.write_text(out.name)
    os.replace(tmp, latest)
    summary = "sharded model" if sharded else state_fingerprint(model, optimizer)
    log.info("checkpoint of step %d written to %s (%s)", state.step, out, summary)
    return out


def load_checkpoint(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    collective: bool = True) -> RunState:
    """Load model and optimizer state from `ckpt` in place and return its RunState (RNG not applied).

    collective=True: every rank of the default process group calls this together (DCP plans the
    reads collectively); the pool may have any size, whatever the size of the pool that wrote it.
    """
    if (ckpt / LEGACY_STATE).exists() and not (ckpt / DCP_DIR).exists():
        return _load_legacy(ckpt, model, optimizer)
    if not (ckpt / DCP_DIR / ".metadata").exists() or not (ckpt / RUN_STATE).exists():
        raise ModelError(f"{ckpt} is not a complete trainer checkpoint (no {DCP_DIR}/.metadata or {RUN_STATE}); "
                         "point checkpoints/latest at an earlier step_* directory")
    raw = torch.load(ckpt / RUN_STATE, weights_only=True)
    if raw.get("format", 0) > FORMAT_VERSION:
        raise ModelError(f"{ckpt} has checkpoint format {raw['format']}; this version reads up to {FORMAT_VERSION}")
    check_resumed_shape(ckpt, raw, model)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # initialises Adam state so DCP has targets
    state: dict[str, Any] = {"model": checkpoint_model_state(model, model_sd), "optim": optim_sd}
    no_dist = not collective or not dist.is_initialized()
    with _quiet(no_dist):
        dcp.load(state, checkpoint_id=ckpt / DCP_DIR, no_dist=no_dist)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=lora_spec(model) is None))
    rs = RunState(step=int(raw["step"]), policy_version=int(raw["policy_version"]), rng=raw["rng"],
                  unreleased=[(int(s), list(ids)) for s, ids in raw["unreleased"]],
                  world_size=int(raw["world_size"]), format=int(raw["format"]))
    log.info("loaded checkpoint %s of step %d (policy version %d, written by %d ranks): %s", ckpt, rs.step,
             rs.policy_version, rs.world_size, state_fingerprint(model, optimizer))
    return rs


def load_model_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Only the model's weights from a checkpoint, in one process (no optimizer, no process group):
    for evaluation or to start a new run from a trained policy."""
    if not (ckpt / DCP_DIR / ".metadata").exists():
        raise ModelError(f"{ckpt} has no DCP checkpoint; load its Hugging Face export with model.path={ckpt}")
    state = {"model": checkpoint_model_state(model, model.state_dict())}
    with _quiet(True):
        dcp.load(state, checkpoint_id=ckpt / DCP_DIR, no_dist=True)
    model.load_state_dict(state["model"], strict=lora_spec(model) is None)


def state_fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A short exact summary of model and optimizer state to compare across processes and pool sizes:
    the float64 sums of the first parameter and of every parameter, and of Adam's first and second
    moments (`exp_avg`, `exp_avg_sq`) and the Adam step of the first parameter."""
    params = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())  # LoRA: the adapters
    total = sum(float(p.detach().double().sum()) for p in params)
    st = optimizer.state.get(params[0], {})
    m = float(st["exp_avg"].double().sum()) if "exp_avg" in st else 0.0
    v = float(st["exp_avg_sq"].double().sum()) if "exp_avg_sq" in st else 0.0
    step = float(st["step"]) if "step" in st else 0.0
    return (f"fingerprint param0 {float(params[0].detach().double().sum())!r} params {total!r} "
            f"exp_avg0 {m!r} exp_avg_sq0 {v!r} adam_step0 {step!r}")


def _load_legacy(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> RunState:
    """A checkpoint written before DCP: HF weights plus rank 0's torch.save of the optimizer."""
    from earl_stream.model.loading import load_model

    saved, _ = load_model(ckpt)
    model.load_state_dict(saved.state_dict())
    raw = torch.load(ckpt / LEGACY_STATE, weights_only=True)
    optimizer.load_state_dict(raw["optimizer"])
    log.info("loaded checkpoint %s in the format before DCP (step %d)", ckpt, raw["step"])
    return RunState(step=int(raw["step"]), policy_version=int(raw.get("policy_version", raw["step"])),
                    rng=raw["rng"], unreleased=[(int(s), list(ids)) for s, ids in raw.get("unreleased", [])],
                    format=1)


def _atomic_torch_save(obj: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@contextmanager
def _quiet(no_dist: bool) -> Iterator[None]:
    """DCP warns on every single-process save or load that it assumes one process: here that is meant."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
