"""Laying a Hugging Face causal LM out on a trainer placement, and re-laying it live.

Owns `shard_model` (tensor parallel with DTensor `parallelize_module`, then FSDP2 `fully_shard`),
`relayout` (a plan change at a step boundary: model and optimizer state move onto the new mesh shard
to shard, bucket by bucket, with `workers.reshard`; never a full replica; no restart, same math) and `shard_pieces` (which
parameter pieces this rank holds and publishes). Under ep the experts of a mixture-of-experts model
are `workers.expert_parallel`'s (FSDP2 ignores them). Works for any dense decoder-only family:
which modules are decoder layers and how tensor parallel splits them is `workers.tensor_parallel`'s
answer, from the model's own `_no_split_modules` and `config.base_model_tp_plan`.

Tensor parallel (Megatron-style, the model's own plan: q/k/v/gate/up column-wise, o/down row-wise,
or gathered where a norm or a fused projection needs every head), the embedding row-wise over the
vocabulary, the LM head column-wise over the vocabulary with its output left sharded
(`workers.vocab_parallel` computes log-probs from the shards). A tied LM head shares the
embedding's vocabulary shard. FSDP2 then shards every decoder layer and the root over the data
mesh (`mesh.Placement.mesh`), with gradients summed (divide factor 1), since the loss is already
normalised by the claim's token count; under bf16 its mixed-precision policy gathers bf16 weights
per layer and reduces gradients in fp32.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from transformers import PreTrainedModel

from earl_stream.errors import ConfigError
from earl_stream.store.weights import WeightPiece, distinct_tensors
from earl_stream.workers.expert_parallel import is_expert_param, shard_experts
from earl_stream.workers.mesh import Placement, is_shard
from earl_stream.workers.reshard import DEFAULT_BUCKET_BYTES, copy_buffers, copy_local_state, meta_like, move_state
from earl_stream.workers.tensor_parallel import decoder_layers, tp_plan
from earl_stream.workers.ulysses import set_sequence_parallel

log = logging.getLogger(__name__)

def _tensor_parallel(model: torch.nn.Module, placement: Placement) -> None:
    assert placement.mesh is not None
    hf: Any = model
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    parallelize_module(model, placement.mesh["tp"], tp_plan(model))
    if tied:  # both shard the [vocab, hidden] weight on dim 0: one parameter again
        hf.get_output_embeddings().weight = hf.get_input_embeddings().weight


def _fully_shard(model: torch.nn.Module, placement: Placement) -> None:
    assert placement.mesh is not None
    plan = placement.plan
    mesh = placement.mesh["replicate", "shard"] if plan.dp > 1 else placement.mesh["shard"]
    # bf16: gather each layer's weights in bf16 and free them after use (autocast alone would keep a bf16
    # copy of the whole unsharded model for the backward pass); gradients are reduced and kept in fp32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if plan.dtype == "bf16" \
        else MixedPrecisionPolicy()
    experts = {p for p in model.parameters() if is_expert_param(p)} or None  # ep shards them, FSDP leaves them
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, ignored_params=experts)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=experts)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def shard_model(model: torch.nn.Module, placement: Placement) -> torch.nn.Module:
    """Lay a plain (unsharded) `model` out in place under `placement`: tp, ep (the experts), then FSDP2
    (the rest)."""
    if placement.plan.tp > 1:
        _tensor_parallel(model, placement)
    if placement.plan.ep > 1:
        if placement.ep_mesh is None:
            raise ConfigError(f"a plan with ep={placement.plan.ep} needs a pool of ranks (torch.distributed)")
        shard_experts(model, placement.ep_mesh)
    if placement.plan.fsdp > 1:
        _fully_shard(model, placement)
    return model


@dataclasses.dataclass
class Relaid:
    model: PreTrainedModel
    optimizer: torch.optim.Optimizer | None
    buckets: int = 0  # how many buckets the move took


def relayout(model: PreTrainedModel, optimizer: torch.optim.Optimizer | None, placement: Placement,
             make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], *,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Relaid:
    """The same weights and optimizer state on a new model laid out under `placement`.

    Collective (every rank of the pool, together). The new model is built and laid out on the meta
    device, then only this rank's shards are materialised on `placement.device`; parameters and
    AdamW state move into them shard to shard, `bucket_bytes` of whole tensors at a time
    (`reshard.move_state`), so no rank ever holds a replica it would not hold under either plan. The
    old model and optimizer are spent (their storage is freed as it moves). The math of the next step
    does not change. An optimizer that has not stepped yet has no state to move and is made fresh
    (moving it would initialise it and advance Adam's step count).
    """
    hf: Any = model
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    new: Any = shard_model(meta_like(model), placement)
    new.to_empty(device=placement.device)
    if tied and not placement.plan.sharded:  # to_empty gave each module of a plain model a parameter of its own
        new.tie_weights()
    if tied and new.get_output_embeddings().weight is not new.get_input_embeddings().weight:
        raise ConfigError("re-shard: the tied LM head came apart from the embedding on the new model")
    copy_buffers(model, new)
    new_optimizer = make_optimizer(new) if optimizer is not None else None
    buckets = move_state(model, new, optimizer, new_optimizer, bucket_bytes=bucket_bytes)
    return Relaid(new, new_optimizer, buckets)


def reset_fsdp(model: torch.nn.Module) -> None:
    """FSDP2's state after a step that failed inside a forward or backward: its per-iteration state cleared and
    every parameter group resharded (local: the sharded copy is kept), so that the model's parameters are its
    shards again. A plain `reshard()` is not enough: a group the failure left in its forward (the root's,
    which holds the embeddings and the LM head, failing in the logits) keeps its parameters unsharded.
    `FSDPModule.reset_iter_state` on the root does it (torch >= 2.13); else each module is resharded."""
    if isinstance(model, FSDPModule) and hasattr(model, "reset_iter_state"):
        try:
            model.reset_iter_state()
            return
        except RuntimeError as exc:  # not the root of its FSDP tree, or a wait on an aborted group's work
            log.warning("FSDP reset after the failed step: %s; resharding module by module", exc)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def rebind(model: PreTrainedModel, optimizer: torch.optim.Optimizer | None, placement: Placement,
           make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> Relaid:
    """The same model and optimizer state under the same plan, on `placement`'s meshes: after the pool's
    process group was re-formed (`workers.pool_abort`) the DTensors still name the old, aborted groups.
    Every rank keeps the same coordinates, so each shard stays where it is: a local copy, no collective.
    FSDP modules a failed step left unsharded are resharded first (`reset_fsdp`)."""
    reset_fsdp(model)
    hf: Any = model
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    new: Any = shard_model(meta_like(model), placement)
    new.to_empty(device=placement.device)
    if tied and not placement.plan.sharded:
        new.tie_weights()
    copy_buffers(model, new)
    new_optimizer = make_optimizer(new) if optimizer is not None else None
    copy_local_state(model, new, optimizer, new_optimizer)
    return Relaid(new, new_optimizer)


def shard_pieces(state: dict[str, torch.Tensor], placement: Placement) -> list[WeightPiece]:
    """The pieces of a state dict this rank publishes: each distinct block of each tensor exactly once
    in the pool, so that the pool's pieces cover every tensor, and a tensor several names share (a tied LM
    head) under its first name only (`store.weights.distinct_tensors`). A tensor every rank holds whole (a data
    parallel replica) goes to the rank that has published the fewest bytes so far (the same greedy pass
    on every rank), so that no rank keeps a whole replica per version in its node and a pull reads from
    every rank at once; a sharded block goes to the lowest rank that holds it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    layout = placement.layout
    out = []
    load = [0] * max(1, placement.world)  # bytes of whole tensors given to each rank so far
    for name, value in distinct_tensors(state).items():
        if not isinstance(value, DTensor):  # replicated everywhere
            owner = load.index(min(load))
            load[owner] += value.numel() * value.element_size()
            if owner == layout.rank:
                out.append(WeightPiece(name, value.detach(), tuple(value.shape), (0,) * value.dim()))
            continue
        value = _blockwise(value)
        mesh = value.device_mesh
        coord = mesh.get_coordinate()
        assert coord is not None
        replicas_first = all(c == 0 for c, pl in zip(coord, value.placements) if not is_shard(pl))
        # the ranks outside this tensor's mesh hold copies too: only the first of them publishes
        outside_first = _first_outside(mesh, layout)
        if not (replicas_first and outside_first):
            continue
        shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
        out.append(WeightPiece(name, value.to_local().detach(), tuple(value.shape), tuple(offset)))
    return out


def _blockwise(value: DTensor) -> DTensor:
    """`value` laid out so that each rank's local tensor is one contiguous block of the whole: where two
    mesh dims shard the same tensor dim (FSDP over a tensor-parallel shard: a strided shard), the outer
    one is gathered (collective over that mesh dim; every rank publishes the same tensors in order)."""
    placements = list(value.placements)
    seen: set[int] = set()
    for i in reversed(range(len(placements))):  # inner mesh dims (tp) keep their shards
        pl = placements[i]
        if is_shard(pl):
            if not isinstance(pl, Shard) or pl.dim in seen:
                placements[i] = Replicate()
            else:
                seen.add(pl.dim)
    return value if placements == list(value.placements) else value.redistribute(placements=placements)


def _first_outside(mesh: Any, layout: Any) -> bool:
    """This rank is coordinate 0 on every pool axis the mesh does not span."""
    names = set(mesh.mesh_dim_names or ())
    if "ep" in names:  # the expert mesh spans the whole pool (ep runs with tp = sp = 1)
        return True
    if "shard" in names:  # FSDP spans replicate x shard (or shard alone) and, under tp, tp too
        return "tp" in names or layout.tp_rank == 0
    # a tensor-parallel-only tensor: every data and sp rank holds the same shard
    return layout.dp_rank == 0 and layout.cp_rank == 0


def apply_plan(model: torch.nn.Module, placement: Placement, *, extra_models: Iterable[Any] = ()) -> None:
    """The per-step knobs of `placement` on an already laid-out model: activation recomputation on/off
    and the Ulysses sp group (the micro-batch budget goes into the step's `partition`)."""
    plan = placement.plan
    if plan.sp > 1 and placement.sp_group is None:
        raise ConfigError(f"a plan with sp={plan.sp} needs a pool of ranks (torch.distributed) with sp groups")
    hf: Any = model
    if plan.recompute:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf.gradient_checkpointing_disable()
    set_sequence_parallel([hf, *extra_models], placement.sp_group, plan.sp, placement.layout.cp_rank)
