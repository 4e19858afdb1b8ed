"""Moving a model's parameters and AdamW state from one placement to another, shard to shard.

Owns the pieces of a live re-shard that never hold a full replica: `meta_like` (the model's
architecture on the meta device, to be laid out and then materialised as this rank's shards only),
`copy_buffers` (buffers, e.g. rotary `inv_freq`, which meta init leaves empty and no placement
shards) and `move_state` (parameters and optimizer state, bucket by bucket). Laying the new model out
(tensor parallel, FSDP2) is `workers.sharding`'s job; `sharding.relayout` composes the two.

A bucket holds at most `bucket_bytes` of *full* tensors (a single larger tensor is a bucket of its
own). For each bucket, every tensor of the old placement is made whole (`DTensor.full_tensor()`, an
all-gather over the old mesh; a plain tensor already is) and its storage is freed at once; this rank's
piece of the new placement is then cut from it locally (`distribute_tensor` with no source rank: no
communication, FSDP's strided shards over a tensor-parallel shard included) and copied into the new
parameter or optimizer state. A rank's peak is thus its old shards + its new shards + one bucket.
Every rank walks the same tensors in the same order, so the collectives match. Expert-parallel
experts (`workers.expert_parallel`: DTensors `Shard(0)` on the (edp, ep) mesh) move the same way:
gathered over their ep ranks, cut locally for FSDP, another ep degree, or a plain replica.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from earl_stream.errors import ConfigError
from earl_stream.model.lora import apply_lora, lora_spec

log = logging.getLogger(__name__)
MIB = 1 << 20
DEFAULT_BUCKET_BYTES = 64 * MIB


def meta_like(model: torch.nn.Module) -> torch.nn.Module:
    """An uninitialised plain copy of `model`'s architecture on the meta device (no memory), in the
    dtype of `model`'s parameters, with a tied LM head tied again and the same train/eval mode."""
    from transformers.initialization import no_init_weights

    hf: Any = model
    config = copy.deepcopy(hf.config)
    # FSDP2 swaps a sharded module's class for a subclass of FSDPModule: build the model's own class
    cls: Any = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with no_init_weights(), torch.device("meta"):
        new: Any = cls(config)
    new.tie_weights()  # skipped with the initialisation: a tied LM head must share the embedding again
    if (spec := lora_spec(model)) is not None:  # the same adapters, so that parameters pair up by name
        with torch.device("meta"):
            apply_lora(new, spec)
    dtypes = {p.dtype for p in model.parameters()}
    new.to(dtypes.pop() if len(dtypes) == 1 else torch.float32)
    new.train(model.training)
    return new


def copy_buffers(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """`old`'s buffers into `new` (materialised, laid out): meta init leaves them empty, and the
    non-persistent ones (rotary `inv_freq`) are in no state dict. Placements never shard buffers."""
    mine = dict(old.named_buffers())
    with torch.no_grad():
        for name, buf in new.named_buffers():
            if name not in mine:
                raise ConfigError(f"re-shard: the new model has a buffer {name!r} the old one lacks")
            buf.copy_(_local(mine[name]))


@dataclasses.dataclass
class _Item:
    """One tensor to move: `old` (a parameter or an optimizer state, old placement) becomes this
    rank's piece of `like`'s placement, handed to `put`."""

    name: str
    old: torch.Tensor
    like: torch.Tensor
    put: Callable[[torch.Tensor], None]

    @property
    def full_bytes(self) -> int:
        return self.old.numel() * self.old.element_size()


def move_state(old: torch.nn.Module, new: torch.nn.Module, old_optimizer: torch.optim.Optimizer | None,
               new_optimizer: torch.optim.Optimizer | None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Move `old`'s parameters into `new`'s (laid out and materialised) and, when `old_optimizer` has
    stepped, its state into `new_optimizer` (built over `new`'s parameters), bucket by bucket; the old
    storage is freed as it goes (`old` and `old_optimizer` are spent). Hyper-parameters of the
    parameter groups carry over. Collective over the pool. Returns the number of buckets."""
    if bucket_bytes < 1:
        raise ConfigError(f"reshard bucket of {bucket_bytes} bytes: must be >= 1")
    pairs = _pairs(old, new)
    if old_optimizer is not None and new_optimizer is not None:
        for group, fresh in zip(old_optimizer.param_groups, new_optimizer.param_groups, strict=True):
            fresh.update({k: v for k, v in group.items() if k != "params"})
    items = list(_items(pairs, old_optimizer, new_optimizer))
    buckets = 0
    for bucket in _buckets(items, bucket_bytes):
        _move_bucket(bucket)
        buckets += 1
    for _, o, _ in pairs:  # what the optimizer did not own (or was not moved) is freed all the same
        _free(o)
    if old_optimizer is not None:
        old_optimizer.state.clear()
    return buckets


def copy_local_state(old: torch.nn.Module, new: torch.nn.Module, old_optimizer: torch.optim.Optimizer | None,
                     new_optimizer: torch.optim.Optimizer | None) -> None:
    """`old`'s parameters and optimizer state into `new`, laid out the same way on other meshes (the same
    plan on a re-formed process group): each rank's local shards are copied as they are, no collective."""
    for name, o, n in _pairs(old, new):
        if _local(o).shape != _local(n).shape:
            raise ConfigError(f"re-bind: {name}'s local shard is {tuple(_local(o).shape)} here, "
                              f"{tuple(_local(n).shape)} on the new mesh")
        with torch.no_grad():
            _local(n).copy_(_local(o))
        state = old_optimizer.state.get(o) if old_optimizer is not None else None
        if state and new_optimizer is not None:
            new_optimizer.state[n] = {k: _rewrap(v, n) for k, v in state.items()}


def _rewrap(value: Any, like: torch.Tensor) -> Any:
    """An optimizer state tensor on `like`'s mesh (a DTensor of the parameter's placement), else as it is."""
    if not isinstance(value, DTensor) or not isinstance(like, DTensor):
        return value
    return DTensor.from_local(value.to_local(), like.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _pairs(old: torch.nn.Module, new: torch.nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, old parameter, new parameter) in the old model's order; tied parameters once."""
    fresh = dict(new.named_parameters())
    mine = dict(old.named_parameters())
    if set(fresh) != set(mine):
        raise ConfigError(f"re-shard: parameters differ between the old and the new model: "
                          f"{sorted(set(fresh) ^ set(mine))[:8]} (a tie broken on one side?)")
    out: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for name, o in mine.items():
        n = fresh[name]
        if tuple(n.shape) != tuple(o.shape):
            raise ConfigError(f"re-shard: {name} is {tuple(o.shape)} in the old model, {tuple(n.shape)} in the new")
        n.requires_grad_(o.requires_grad)
        out.append((name, o, n))
    return out


def _items(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], old_optimizer: torch.optim.Optimizer | None,
           new_optimizer: torch.optim.Optimizer | None) -> Iterator[_Item]:
    """Each parameter, then (if the optimizer stepped) its state tensors of the parameter's shape;
    other state (Adam's `step`) is copied as it is."""
    moving = old_optimizer is not None and new_optimizer is not None and bool(old_optimizer.state)
    for name, o, n in pairs:
        yield _Item(name, o, n, _into(n))
        if not moving:
            continue
        assert old_optimizer is not None and new_optimizer is not None
        if o not in old_optimizer.state:  # a frozen parameter (LoRA's base) has no state to move
            continue
        state = old_optimizer.state[o]
        target: dict[str, Any] = new_optimizer.state[n]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(o.shape) and value.dim() > 0:
                yield _Item(f"{name}:{key}", value, n, _state_into(target, key, value.dtype, n))
            else:
                target[key] = value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _into(param: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def put(piece: torch.Tensor) -> None:
        _local(param).copy_(piece)
    return put


def _state_into(target: dict[str, Any], key: str, dtype: torch.dtype, like: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def put(piece: torch.Tensor) -> None:
        value = torch.empty_like(like.detach(), dtype=dtype)
        _local(value).copy_(piece)
        target[key] = value
    return put


def _buckets(items: list[_Item], bucket_bytes: int) -> Iterator[list[_Item]]:
    bucket: list[_Item] = []
    size = 0
    for item in items:
        if bucket and size + item.full_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += item.full_bytes
    if bucket:
        yield bucket


@torch.no_grad()
def _move_bucket(bucket: list[_Item]) -> None:
    fulls = []
    for item in bucket:  # whole tensors of this bucket only; a gathered one frees its old shard at once
        full = item.old.full_tensor() if isinstance(item.old, DTensor) else item.old.detach()
        if not _shares(full, item.old):
            _free(item.old)
        fulls.append(full)
    for item, full in zip(bucket, fulls):
        item.put(_piece(full, item.like))
        _free(item.old)  # a plain old tensor was its own whole: freed once its piece is copied
    fulls.clear()


def _piece(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's block of `full` under `like`'s placement, cut locally (no communication)."""
    if not isinstance(like, DTensor):
        return full
    if full.device != like.device:
        full = full.to(like.device)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(_local(a).untyped_storage().data_ptr() == _local(b).untyped_storage().data_ptr())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _free(t: torch.Tensor) -> None:
    """Release `t`'s storage now, whoever else still refers to the tensor object (its module, the
    optimizer's state dict, autograd)."""
    local = t._local_tensor if isinstance(t, DTensor) else t.data  # noqa: SLF001 - the shard's own storage
    storage = local.untyped_storage()
    if storage.nbytes() == 0:
        return
    try:
        storage.resize_(0)
    except RuntimeError:  # not resizable (e.g. memory-mapped from a file): dropped with the old model instead
        log.debug("re-shard: storage of a %s tensor is not resizable; freed with the old model",
                  tuple(t.shape))
