"""The parameter tensors of a model shape, and what one trainer rank holds of each under a placement.

Owns `ParamTensor`, `parameter_tensors` (the parameters in the order `named_parameters()` yields them: the
exact tensors of a shape read from its model, else the Llama / Qwen2 / Mistral formulas, dense or
mixture-of-experts), `plan_tensors` (those of a full or a LoRA run),
`rank_share` (the fullest rank's elements of a tensor under tp, FSDP and ep) and `published_share_bytes`
(the weights one rank publishes per policy version: `workers.sharding.shard_pieces`). `memory_model` (a
step's peak) and `switch_memory` (a plan switch's peak) both count from here.

Under tensor parallelism q/k/v/gate/up (weights and biases) are split on their rows, o/down weights on
their columns, the embedding and LM head on the vocabulary; norms and the row-wise biases stay whole.
FSDP splits every tensor over its shard degree (on top of tp); the largest share (the first rank's,
FSDP's chunks are ceil-sized) is counted. Expert parallel (ep) splits the fused experts' dim 0 ep-way
and FSDP leaves them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

from earl_stream.supervisor.model_shape import ModelShape


@dataclasses.dataclass(frozen=True)
class ParamTensor:
    """One parameter: its shape and how tensor parallelism splits it (dim, or None = replicated)."""

    rows: int
    cols: int
    tp_dim: int | None
    trained: bool = True  # has AdamW state (False: LoRA's frozen base)
    expert: bool = False  # a fused expert tensor (rows = experts x ...): split by ep, not by FSDP

    @property
    def numel(self) -> int:
        return self.rows * self.cols


_COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj"})
_ROWWISE = frozenset({"o_proj", "down_proj"})


def _exact_tensors(shape: ModelShape) -> Iterator[ParamTensor]:
    """`shape.tensors` as ParamTensors: column-parallel projections (and their biases) split on rows,
    row-parallel ones on columns (their biases whole), the embedding and LM head on the vocabulary,
    fused expert tensors [E, out, in] by ep; everything else (norms, routers) replicated."""
    for name, dims in shape.tensors:
        parts = name.split(".")
        leaf = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
        rows, cols = dims[0], 1
        for d in dims[1:-1]:
            rows *= d
        cols = dims[-1] if len(dims) > 1 else 1
        if len(dims) == 3 and "experts" in name:
            yield ParamTensor(rows, cols, None, expert=True)
        elif not name.startswith(shape.layer_prefix):
            yield ParamTensor(rows, cols, 0 if len(dims) == 2 else None)
        elif leaf in _COLWISE:
            yield ParamTensor(rows, cols, 0)
        elif leaf in _ROWWISE:
            yield ParamTensor(rows, cols, 1 if len(dims) == 2 else None)
        else:
            yield ParamTensor(rows, cols, None)


def parameter_tensors(shape: ModelShape) -> Iterator[ParamTensor]:
    """The parameters in the order `named_parameters()` yields them: exact when the shape was read from
    its model (`ModelShape.tensors`), else from the Llama / Qwen2 / Mistral formulas."""
    if shape.tensors:
        yield from _exact_tensors(shape)
        return
    h, inter, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    yield ParamTensor(v, h, 0)  # embed_tokens
    for layer in range(shape.num_layers):
        for out in (q, kv, kv):
            yield ParamTensor(out, h, 0)
            if shape.qkv_bias:
                yield ParamTensor(out, 1, 0)
        yield ParamTensor(h, q, 1)
        if shape.o_bias:
            yield ParamTensor(h, 1, None)
        if layer < shape.moe_layers:  # router, then the fused experts (order within a layer barely matters)
            e, es = shape.num_experts, shape.expert_size
            yield from (ParamTensor(e, h, None), ParamTensor(e * 2 * es, h, None, expert=True),
                        ParamTensor(e * h, es, None, expert=True))
            yield ParamTensor(h, 1, None)
            yield ParamTensor(h, 1, None)
            continue
        for dims in ((inter, h, 0), (inter, h, 0), (h, inter, 1)):
            yield ParamTensor(*dims)
            if shape.mlp_bias:
                yield ParamTensor(dims[0], 1, 0 if dims[2] == 0 else None)
        yield ParamTensor(h, 1, None)
        yield ParamTensor(h, 1, None)
    yield ParamTensor(h, 1, None)  # the final norm
    if not shape.tie_word_embeddings:
        yield ParamTensor(v, h, 0)  # lm_head


@functools.cache
def plan_tensors(shape: ModelShape, lora_params: int = 0) -> tuple[ParamTensor, ...]:
    """The parameters a run trains: all of them, or (LoRA, `lora_params` adapter parameters) a frozen base
    plus each layer's adapters (as one replicated tensor per layer: their AdamW state moves with them)."""
    if not lora_params:
        return tuple(parameter_tensors(shape))
    base = [dataclasses.replace(t, trained=False) for t in parameter_tensors(shape)]
    per_layer = lora_params // max(1, shape.num_layers)
    return (*base, *[ParamTensor(per_layer, 1, None) for _ in range(shape.num_layers)])


def rank_share(t: ParamTensor, *, tp: int, fsdp_shards: int, ep: int) -> tuple[int, bool]:
    """(elements on the fullest rank, whether the tensor is a DTensor) of `t` under a placement of tp
    degree `tp`, FSDP over `fsdp_shards` ranks (0 or 1: no FSDP) and expert parallel degree `ep`."""
    rows, cols = t.rows, t.cols
    split = False
    if t.expert and ep > 1:
        return rows // ep * cols, True
    if tp > 1 and t.tp_dim is not None:
        rows, cols = (rows // tp, cols) if t.tp_dim == 0 else (rows, cols // tp)
        split = True
    if fsdp_shards > 1:
        rows, split = math.ceil(rows / fsdp_shards), True
    return rows * cols, split


@functools.cache  # a function of the shape and the layout alone; the selector asks it for every budget it weighs
def published_share_bytes(shape: ModelShape, *, devices: int, tp: int, fsdp_shards: int, ep: int,
                          element_bytes: int, lora_params: int = 0) -> int:
    """Bytes of one policy version the fullest rank of a pool of `devices` publishes into its shard node
    (`workers.sharding.shard_pieces`): its block of every sharded tensor, and its part of the whole
    tensors, which the ranks share out greedily by bytes in the model's order. LoRA publishes its
    adapters alone (whole tensors, shared out the same way)."""
    sharded, whole = 0, []
    if lora_params:
        whole = [t.numel for t in plan_tensors(shape, lora_params) if t.trained]
    else:
        for t in parameter_tensors(shape):  # a tied head shares the embedding's storage: published once, as it
            n, split = rank_share(t, tp=tp, fsdp_shards=fsdp_shards, ep=ep)
            if split:
                sharded += n
            else:
                whole.append(n)
    load = [0] * max(1, devices)
    for n in whole:
        load[load.index(min(load))] += n
    return (sharded + max(load)) * element_bytes
