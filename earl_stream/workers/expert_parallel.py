"""Expert parallelism (ep): the experts of each mixture-of-experts layer sharded over the ep ranks of a
trainer pool, tokens sent to the rank that owns their expert and back.

Owns `expert_blocks` (the fused expert modules of a Hugging Face Qwen3-MoE / Mixtral model: parameters
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]), `ep_problems` (why a model cannot run under an ep
degree), `shard_experts` (each expert parameter becomes a DTensor `Shard(0)` over the placement's
`ep` mesh dimension: rank e holds experts [e E/ep, (e+1) E/ep), replicated over the `edp` dimension,
and the module's forward becomes `_ep_forward`) and `is_expert_param`. The router (`gate`) stays a
replicated (or FSDP-sharded) parameter, so routing replay's hooks see and steer every choice as in a
single process. Which ranks form the ep and edp groups is `workers.mesh`'s; laying out the rest of the
model (FSDP2, which leaves the expert parameters to this module) is `workers.sharding`'s; moving
experts between plans is `workers.reshard`'s (DTensor to DTensor, like any other parameter).

The forward of one layer on one rank, for its N tokens with top-k choices (all differentiable):
1. each (token, choice) pair goes to the owner of its expert: pairs sorted by owner, the counts
   exchanged (`all_to_all_single`), the hidden states [N k, H] sent with one all-to-all;
2. the rank runs its E/ep local experts over what it received (SwiGLU, as the HF expert block);
3. the outputs go back with the reverse all-to-all, are scaled by the router weights and summed
   per token (as the HF block's `index_add_`).
The gradients of the local experts thus sum over every token of the ep group; over the `edp` ranks
(other data ranks with the same experts) they are summed by `mesh.reduce_gradients`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from earl_stream.errors import ConfigError

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
EP_MESH_DIMS = ("edp", "ep")  # the expert mesh: data ranks holding the same experts x expert shards


def expert_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The fused expert modules of `model` (3-D `gate_up_proj` and `down_proj`), in layer order."""
    out = []
    for module in model.modules():
        params = [getattr(module, n, None) for n in EXPERT_PARAMS]
        if all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in params) and hasattr(module, "act_fn"):
            out.append(module)
    return out


def ep_problems(config: Any, ep: int) -> list[str]:
    """Why a model with HF `config` (a PretrainedConfig or a dict) cannot run with experts over `ep` ranks."""
    if ep == 1:
        return []
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    from earl_stream.model.moe_config import moe_layers, num_experts

    if not moe_layers(d):
        return [f"ep={ep}: model_type={d.get('model_type')!r} has no routed experts (a dense model); "
                "expert parallelism needs a mixture-of-experts model"]
    experts = num_experts(d)
    if experts % ep:
        return [f"ep={ep} does not divide the {experts} experts per layer"]
    return []


def is_expert_param(p: torch.Tensor) -> bool:
    """A parameter laid out by `shard_experts` (a DTensor on the expert mesh)."""
    return isinstance(p, DTensor) and tuple(p.device_mesh.mesh_dim_names or ()) == EP_MESH_DIMS


@dataclasses.dataclass(frozen=True)
class _Shard:
    """One rank's place among the ep ranks of a layer."""

    group: Any
    ep: int
    local: int  # experts per rank


def shard_experts(model: torch.nn.Module, mesh: DeviceMesh) -> list[torch.nn.Parameter]:
    """Shard every expert block of `model` over `mesh` (dims `EP_MESH_DIMS`) in place; plain, meta or
    materialised alike (each rank cuts its own block, no communication). Returns the new parameters."""
    if tuple(mesh.mesh_dim_names or ()) != EP_MESH_DIMS:
        raise ConfigError(f"expert parallel needs a mesh with dims {EP_MESH_DIMS}, got {mesh.mesh_dim_names}")
    ep = mesh.size(1)
    blocks: list[Any] = expert_blocks(model)
    if not blocks:
        raise ConfigError(f"ep={ep}: {type(model).__name__} has no fused expert blocks to shard")
    out = []
    for block in blocks:
        experts = int(block.gate_up_proj.shape[0])
        if experts % ep:
            raise ConfigError(f"ep={ep} does not divide the {experts} experts of {type(block).__name__}")
        for name in EXPERT_PARAMS:
            old = getattr(block, name)
            new = torch.nn.Parameter(distribute_tensor(old.detach(), mesh, [Replicate(), Shard(0)], src_data_rank=None),
                                     requires_grad=old.requires_grad)
            setattr(block, name, new)
            out.append(new)
        shard = _Shard(group=mesh.get_group("ep"), ep=ep, local=experts // ep)
        block.forward = functools.partial(_ep_forward, block, shard)  # the instance's, not the class's
    return out


def _ep_forward(block: torch.nn.Module, shard: _Shard, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The HF expert block's forward under ep: hidden_states [N, H], top_k_index / top_k_weights [N, k]
    -> [N, H], the sum over each token's k experts of weight x expert(hidden)."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    owner = torch.div(flat, shard.local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=shard.ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=shard.group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    token = order // k
    local_ids = (flat[order] - owner[order] * shard.local).contiguous()
    got_ids = local_ids.new_empty(sum(recv_sizes))
    dist.all_to_all_single(got_ids, local_ids, recv_sizes, send_sizes, group=shard.group)
    sent = hidden_states.index_select(0, token)
    got = _exchange(sent, recv_sizes, send_sizes, shard.group)
    done = _local_experts(block, got, got_ids, shard.local)
    back = _exchange(done, send_sizes, recv_sizes, shard.group)
    weighted = back * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))


def _exchange(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> torch.Tensor:
    """Differentiable all-to-all of rows: `in_sizes[r]` rows of `x` go to rank r, `out_sizes[r]` come from it
    (the backward sends the gradients back the same way)."""
    out = fc.all_to_all_single_autograd(x.contiguous(), out_sizes, in_sizes, group)
    return fc.wait_tensor(out) if isinstance(out, fc.AsyncCollectiveTensor) else out


def _local_experts(block: Any, x: torch.Tensor, ids: torch.Tensor, local: int) -> torch.Tensor:
    """x [R, H] through local expert ids [R] (SwiGLU as the HF block: act(gate) * up, then down)."""
    gate_up, down = block.gate_up_proj.to_local(), block.down_proj.to_local()
    order = torch.argsort(ids, stable=True)
    chunks = x.index_select(0, order).split(torch.bincount(ids, minlength=local).tolist())
    outs = []
    for j, chunk in enumerate(chunks):  # every local expert, even without tokens: each gets a gradient
        gate, up = torch.nn.functional.linear(chunk, gate_up[j]).chunk(2, dim=-1)
        outs.append(torch.nn.functional.linear(block.act_fn(gate) * up, down[j]))
    y = torch.cat(outs)
    return y.new_zeros(y.shape).index_copy(0, order, y)
