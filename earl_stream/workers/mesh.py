"""A trainer rank's place in its pool under a plan, and the model placement that plan implies.

Owns `RankPlan` (the knobs a trainer rank applies at a step boundary: dp replicas x FSDP2 shards x
tensor parallel x Ulysses sequence parallel x expert parallel, micro-batch budget, recomputation,
precision) and
`TrainerMesh`, which turns a plan into this rank's `Placement`: its store `Layout`, the process
groups and `DeviceMesh` the plan needs (created once per shape, collectively, at the step boundary
where every rank adopts the plan), and how gradients are reduced and clipped. Laying a model out
under a placement (tensor parallel, FSDP2, re-sharding) is `workers.sharding`'s job.

Rank order (the store's `Layout.from_rank(rank, dp=dp*fsdp, cp=sp, tp=tp)`): tp innermost, then sp,
then the data ranks (dp replicas x fsdp shards). The model's DeviceMesh under FSDP is
(replicate=dp, shard=fsdp*sp, tp): states are sharded over the fsdp and sp ranks together (as
torchtitan's dp_shard x cp), so FSDP's reduce-scatter also sums the sp ranks' partial gradients.
Without FSDP the gradients are all-reduced over every rank of the same tp rank (the data group).

Expert parallel (ep, mixture-of-experts models, tp = sp = 1): the ep ranks are data ranks too (they
train different rows: data index = (dp index x fsdp + fsdp index) x ep + ep index, ep innermost), and
the experts of each layer are sharded over them (`workers.expert_parallel`) on a mesh (edp, ep) of
its own: the experts' gradients are summed over the edp ranks that hold the same experts, never by
FSDP. The rest of the model is replicated (no FSDP) or FSDP-sharded over fsdp x ep ranks.
Gradients are summed, never averaged: the loss is normalised by the claim's token count.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DTensorPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from earl_stream.errors import ConfigError
from earl_stream.protocol import plan_name
from earl_stream.store.layout import Layout
from earl_stream.workers.expert_parallel import EP_MESH_DIMS, ep_problems, is_expert_param
from earl_stream.workers.tensor_parallel import family_problems


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What a trainer rank runs. Ranks = dp * fsdp * tp * sp * ep.

    `micro_batch_tokens` is in `store.layout.partition`'s units: tokens one sp rank materialises per
    micro-batch, `store.layout.materialised_tokens(rows, sp) // sp` (packed: its slice of the rows'
    total length with the alignment padding; unpacked: rows x its slice of the longest row). The
    wire plan's budget (all sp ranks) divided by sp.
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    sp: int = 1
    micro_batch_tokens: int = 8192
    recompute: bool = False
    dtype: str = "fp32"
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.fsdp * self.tp * self.sp * self.ep

    @property
    def data_ranks(self) -> int:
        """Ranks that train different rows (the store layout's dp axis): ep ranks are data ranks."""
        return self.dp * self.fsdp * self.ep

    @property
    def sharded(self) -> bool:
        """Every parameter is a DTensor (FSDP2 or tensor parallel); no rank holds the whole model. Under
        ep alone only the experts are: the embedding and LM head stay plain tensors."""
        return self.fsdp > 1 or self.tp > 1

    @property
    def model_layout(self) -> tuple[int, int, int, int]:
        """What the parameters' placement depends on (FSDP's (replicate, shard) mesh, tp and ep); a
        plan change that keeps it re-lays nothing."""
        fsdp = (self.dp, self.fsdp * self.sp * self.ep) if self.fsdp > 1 else (0, 0)
        return (*fsdp, self.tp, self.ep)

    @property
    def name(self) -> str:
        """e.g. `dp2`, `fsdp2`, `tp2`, `fsdp2_sp2`, `dp2_tp2`, `ep2`, `fsdp2_ep2`; `dp1` for a single rank."""
        return plan_name(self.dp, self.fsdp, self.tp, self.sp, self.ep)

    @property
    def label(self) -> str:
        """The name with `+rc` under full recomputation, as the selector names its layouts (`fsdp2+rc`)."""
        return self.name + ("+rc" if self.recompute else "")

    def layout(self, rank: int) -> Layout:
        return Layout.from_rank(rank, dp=self.data_ranks, tp=self.tp, cp=self.sp)

    @classmethod
    def from_wire(cls, plan: Any, *, dtype: str = "fp32") -> RankPlan:
        """From the control plane's `protocol.TrainerPlan` (or anything with the same attributes)."""
        return cls(dp=int(plan.dp), fsdp=int(plan.fsdp), tp=int(plan.tp), sp=int(plan.sp),
                   micro_batch_tokens=max(1, int(plan.micro_batch_tokens) // max(1, int(plan.sp))),
                   recompute=bool(plan.recompute), dtype=str(getattr(plan, "dtype", "") or dtype),
                   ep=int(getattr(plan, "ep", 1) or 1))

    def problems(self, world: int, config: Any) -> list[str]:
        """Why this rank pool (of `world` ranks) cannot run the plan on a model with HF `config`."""
        out = []
        for axis in ("dp", "fsdp", "tp", "sp", "ep"):
            if getattr(self, axis) < 1:
                out.append(f"{axis}={getattr(self, axis)} must be >= 1")
        if out:
            return out
        if self.world != world:
            out.append(f"dp x fsdp x tp x sp x ep = {self.world} but the pool has {world} ranks")
        text = config.get_text_config()  # a vision-language model's language model
        heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if heads % (self.tp * self.sp):
            out.append(f"tp x sp = {self.tp * self.sp} does not divide the {heads} attention heads")
        if (self.tp > 1 or self.sp > 1) and (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)):
            out.append(f"tp={self.tp}, sp={self.sp}: mixture-of-experts blocks are not tensor or sequence parallel "
                       "in this version (use dp / fsdp)")
        if self.ep > 1:
            out += ep_problems(config, self.ep)
            if self.tp > 1 or self.sp > 1:
                out.append(f"ep={self.ep} with tp={self.tp}, sp={self.sp}: expert parallel runs with dp / fsdp only "
                           "(tensor and sequence parallel do not split expert blocks in this version)")
        if self.tp > 1:
            for what, size in (("key/value heads", kv), ("vocabulary", text.vocab_size),
                               ("intermediate size", text.intermediate_size)):
                if size % self.tp:
                    out.append(f"tp={self.tp} does not divide the {what} ({size})")
        if self.dtype not in ("fp32", "bf16"):
            out.append(f"dtype={self.dtype!r}; choose fp32 or bf16")
        return out + family_problems(config, tp=self.tp, sp=self.sp)


@dataclasses.dataclass(frozen=True)
class Placement:
    """This rank under a plan: what `train_step` needs to cut, run and reduce its share of a step."""

    plan: RankPlan
    layout: Layout
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None  # the model's mesh (None: plain module, replicated)
    tp_group: Any = None  # vocab-parallel reductions; None when tp == 1
    sp_group: Any = None  # Ulysses all-to-alls; None when sp == 1
    data_group: Any = None  # manual gradient all-reduce (FSDP reduces by itself); WORLD when None and world > 1
    ep_mesh: DeviceMesh | None = None  # the experts' (edp, ep) mesh; None when ep == 1

    @property
    def world(self) -> int:
        return self.plan.world

    @property
    def manual_reduce(self) -> bool:
        return self.world > 1 and self.plan.fsdp == 1

    @property
    def lockstep(self) -> bool:
        """Every data rank runs the same number of forward/backward passes (FSDP gathers in each; ep
        exchanges tokens in each)."""
        return self.plan.fsdp > 1 or self.plan.ep > 1

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.plan.dtype == "bf16" else None

    def vocab_start(self, vocab_size: int) -> int:
        return self.layout.tp_rank * (vocab_size // self.plan.tp)

    @classmethod
    def single(cls, layout: Layout | None = None, *, device: torch.device | str = "cpu", dtype: str = "fp32",
               micro_batch_tokens: int = 8192) -> Placement:
        """A replicated model and a DDP-style all-reduce over the whole pool (when there is one):
        the placement of a `layout` with tp = 1 and no FSDP."""
        layout = layout or Layout()
        if layout.tp_size != 1:
            raise ConfigError("a tensor-parallel layout needs a TrainerMesh placement")
        plan = RankPlan(dp=layout.dp_size, sp=layout.cp_size, micro_batch_tokens=micro_batch_tokens, dtype=dtype)
        return cls(plan=plan, layout=layout, device=torch.device(device))


def pool_backend() -> str:
    """The collective backend of a trainer pool: gloo for CPU tensors and, where CUDA exists, NCCL for
    CUDA tensors (torch routes each collective by its tensors' device), so `trainer.device` may be
    either once the pool is up."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


class TrainerMesh:
    """The meshes and process groups of a pool of `world` ranks, made on demand and kept.

    Making a group is collective: every rank must ask for the same placements in the same order,
    which holds because every rank adopts rank 0's plan at the same step boundary.
    """

    def __init__(self, world: int, rank: int, device: torch.device) -> None:
        self.world, self.rank, self.device = world, rank, device
        self._meshes: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}
        self._groups: dict[tuple[Any, ...], Any] = {}

    def placement(self, plan: RankPlan) -> Placement:
        layout = plan.layout(self.rank)
        if self.world == 1:
            return Placement(plan=plan, layout=layout, device=self.device)
        mesh = tp_group = data_group = None
        if plan.fsdp > 1:
            mesh = self._mesh((plan.dp, plan.fsdp * plan.sp * plan.ep, plan.tp), ("replicate", "shard", "tp"))
        elif plan.tp > 1:
            mesh = self._mesh((plan.data_ranks * plan.sp, plan.tp), ("data", "tp"))
            data_group = mesh.get_group("data")
        if plan.tp > 1 and mesh is not None:
            tp_group = mesh.get_group("tp")
        sp_group = self._sp_group(plan) if plan.sp > 1 else None
        ep_mesh = self._mesh((self.world // plan.ep, plan.ep), EP_MESH_DIMS) if plan.ep > 1 else None
        return Placement(plan=plan, layout=layout, device=self.device, mesh=mesh, tp_group=tp_group,
                         sp_group=sp_group, data_group=data_group, ep_mesh=ep_mesh)

    def _mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        key = (shape, names)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._meshes[key]

    def _sp_group(self, plan: RankPlan) -> Any:
        """The ranks that differ only in their sp coordinate (consecutive tp-strided ranks)."""
        key = ("sp", plan.data_ranks, plan.sp, plan.tp)
        if key not in self._groups:
            mine = None
            for data in range(plan.data_ranks):
                for t in range(plan.tp):
                    ranks = [(data * plan.sp + s) * plan.tp + t for s in range(plan.sp)]
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
            self._groups[key] = mine
        return self._groups[key]


def is_shard(placement: DTensorPlacement) -> bool:
    """A DTensor placement that splits the tensor: Shard, or FSDP's strided shard over a tp shard."""
    return isinstance(placement, (Shard, _StridedShard))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def reduce_gradients(model: torch.nn.Module, placement: Placement) -> None:
    """Sum the partial gradients of the data (and sp) ranks where FSDP did not already; the experts'
    (ep) over the edp ranks that hold the same experts; and, without FSDP (which does it in its
    reduce-scatter), the tp ranks' partial gradients of weights they hold whole but apply to their own
    heads (`workers.tensor_parallel.HeadwiseReplicate`, DTensor `Partial` gradients)."""
    if placement.plan.fsdp == 1:
        for p in model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
    edp = placement.ep_mesh.size(0) if placement.ep_mesh is not None else 1
    if not placement.manual_reduce and edp == 1:
        return
    for p in model.parameters():
        if not p.requires_grad:
            continue
        expert = is_expert_param(p)
        if not (placement.manual_reduce or expert) or (expert and edp == 1):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if expert:
            assert placement.ep_mesh is not None
            dist.all_reduce(_local(p.grad), group=placement.ep_mesh.get_group("edp"))
        else:
            dist.all_reduce(_local(p.grad), group=placement.data_group)


def clip_gradients(model: torch.nn.Module, max_norm: float, placement: Placement) -> float:
    """The global gradient norm over all shards (each counted once); scales gradients to `max_norm`
    when it is > 0 and exceeded. Works for plain, tensor-parallel and FSDP2 parameters alike."""
    total = torch.zeros((), dtype=torch.float64, device=placement.device)
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        pieces = 1
        if isinstance(g, DTensor):
            pieces = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if is_shard(pl))
        # a piece lives on world / pieces ranks: count each copy's share so the all-reduce counts it once
        total += _local(g).detach().double().pow(2).sum() * (pieces / placement.world)
    if placement.world > 1:
        dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                _local(p.grad).mul_(scale)
    return norm
