"""How a trainer rank runs its share of a step under the current plan, and how it switches plans live.

Owns: the plan knobs a trainer rank applies at a step boundary (`RankPlan`: sequence-parallel size,
micro-batch token budget, activation recomputation; `apply_plan`), the sequence-parallel process
groups of a pool (`SequenceParallelGroups`), and Ulysses-style sequence parallelism for Hugging Face
attention (`ulysses_attention`, registered as attention implementation "ulysses"): each rank of an
sp group holds a contiguous 1/sp slice of every sequence outside attention; inside attention an
all-to-all over heads gives each rank H/sp heads of the whole sequence, and a second all-to-all
gives the tokens back (Jacobs et al. 2023, DeepSpeed-Ulysses). Which rows a rank trains is
`store.layout.partition`'s answer (an sp group is its cp axis); the loss math is `algo.grpo`'s.

Data parallel over the dp axis is DDP-style: every rank's gradients are summed with one all-reduce
over the whole pool (`train_step`), which is also what sequence parallelism needs, since each sp
rank's loss covers only its own tokens. The loss is normalised by the claim's token count, so the
sum over ranks of the partial gradients is the gradient of the whole batch under every plan.

Token alignment under sp (`shard_batch`): a micro-batch [B, T] is right-padded to W = ceil(T/sp)*sp;
rank r runs positions [a, b) = [r W/sp, (r+1) W/sp) with their true position ids, and its logits at
position t score token t+1, so its loss tensors are those of positions [a+1, b+1) (the last rank's
last position has no next token and a zero mask). Right padding never leaks into real tokens under
a causal mask, so the padding mask is not needed.

What the store serves an sp rank (`sp_windows`, `sp_token_ranges`, `local_batch`): every rank of an
sp group gets the same rows and micro-batches from `partition` (cp = sp), and pulls of each row only
[a, b + 1) (its slice plus the next token), so a step moves each token about once per sp group. The
slices are contiguous, not `partition`'s zig-zag `token_ranges` (those balance ring attention;
Ulysses computes attention over the whole sequence on every rank, so it needs no balancing).
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import PreTrainedModel

from earl_stream.errors import ConfigError

log = logging.getLogger(__name__)

ULYSSES = "ulysses"
_BASE_ATTR = "_earl_base_attn_implementation"


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """The knobs of a plan a trainer rank applies at a step boundary.

    `micro_batch_tokens` is in `store.layout.partition`'s units: tokens one rank holds per
    micro-batch, counting ceil(length / sp) per row.
    """

    sp: int = 1
    micro_batch_tokens: int = 8192
    recompute: bool = False

    @classmethod
    def from_plan_dict(cls, plan: dict[str, Any]) -> RankPlan:
        """From a `selector.PlanDecision.to_dict()` (as it travels in the claim reply's JSON)."""
        return cls(sp=int(plan["plan"].get("sp", 1)), micro_batch_tokens=int(plan["rank_micro_batch_tokens"]),
                   recompute=plan["plan"]["recompute"] == "full")


@dataclasses.dataclass
class _SpState:
    group: Any = None  # the torch ProcessGroup of this rank's sp group; None when sp == 1
    size: int = 1
    rank: int = 0


_STATE = _SpState()


class SequenceParallelGroups:
    """The sp groups of a pool of `world` ranks for every power-of-two sp dividing it (consecutive
    ranks form a group, as `Layout.from_rank(rank, dp, cp=sp)` orders them).

    Creating groups is collective: construct this on every rank at the same point (start-up), so a
    later plan change needs no collective set-up at the step boundary.
    """

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self._groups: dict[int, Any] = {}
        for sp in (1 << i for i in range(1, world.bit_length())):
            if world % sp:
                continue
            for start in range(0, world, sp):
                group = dist.new_group(list(range(start, start + sp)))
                if start <= rank < start + sp:
                    self._groups[sp] = group

    def sizes(self) -> list[int]:
        return [1, *sorted(self._groups)]

    def group(self, sp: int) -> Any:
        if sp == 1:
            return None
        if sp not in self._groups:
            raise ConfigError(f"sequence-parallel size {sp} is not available on a pool of {self.world} ranks; "
                              f"choose one of {self.sizes()}")
        return self._groups[sp]


def set_sequence_parallel(models: Iterable[PreTrainedModel], group: Any, size: int, rank: int) -> None:
    """Route the models' attention through Ulysses over `group` (size > 1), or back to their own
    attention (size 1). Stays in force for forward and backward (recomputation re-runs attention)."""
    _STATE.group, _STATE.size, _STATE.rank = (group, size, rank) if size > 1 else (None, 1, 0)
    for model in models:
        config: Any = model.config  # _attn_implementation is set on the instance
        if not hasattr(config, _BASE_ATTR):
            setattr(config, _BASE_ATTR, config._attn_implementation or "eager")
        if size > 1:
            heads = config.num_attention_heads
            if heads % size:
                raise ConfigError(f"sequence-parallel size {size} must divide the model's {heads} attention heads")
            config._attn_implementation = ULYSSES
        else:
            config._attn_implementation = getattr(config, _BASE_ATTR)


def apply_plan(model: PreTrainedModel, plan: RankPlan, *, groups: SequenceParallelGroups | None = None,
               rank: int = 0, extra_models: Iterable[PreTrainedModel] = ()) -> None:
    """Adopt `plan` on this rank between two steps: recomputation on/off and the sp group.

    The micro-batch budget is the caller's (it goes into the step's `partition`).
    """
    if plan.recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    if plan.sp > 1 and groups is None:
        raise ConfigError(f"a plan with sp={plan.sp} needs a pool of ranks (torch.distributed) with sp groups")
    group = groups.group(plan.sp) if groups is not None else None
    set_sequence_parallel([model, *extra_models], group, plan.sp, rank % plan.sp)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 ([sp, ...]: chunk i goes to rank i); its own adjoint."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # empty_like would copy a permuted view's strides, which the collective ignores
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _heads_to_sequence(x: torch.Tensor, p: int, group: Any) -> torch.Tensor:
    """[b, heads, n, d] (all heads, my tokens) -> [b, heads/p, p*n, d] (my heads, all tokens)."""
    b, h, n, d = x.shape
    chunks = x.reshape(b, p, h // p, n, d).permute(1, 0, 2, 3, 4)  # [p (head group), b, h/p, n, d]
    got = _AllToAll.apply(chunks, group)  # [p (token slice of rank j), b, h/p, n, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * n, d)


def _sequence_to_heads(x: torch.Tensor, p: int, group: Any) -> torch.Tensor:
    """[b, p*n, heads/p, d] (my heads, all tokens) -> [b, n, heads, d] (all heads, my tokens)."""
    b, s, hp, d = x.shape
    n = s // p
    chunks = x.reshape(b, p, n, hp, d).permute(1, 0, 2, 3, 4)  # [p (token slice), b, n, h/p, d]
    got = _AllToAll.apply(chunks, group)  # [p (head group j), b, n, h/p, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, n, p * hp, d)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face attention interface: q [b, H, n, d], k/v [b, KV, n, d] of this rank's n tokens
    (rotary embedding already applied with global positions) -> ([b, n, H, d], None).

    Causal over the whole sequence; `attention_mask` is ignored (right padding only, see the module
    docstring). kv heads are all-to-all'ed at their own width when sp divides them, else repeated
    to H first. The core runs the model's own implementation (eager materialises the scores).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    p, group = _STATE.size, _STATE.group
    if p == 1 or group is None:
        raise RuntimeError("ulysses attention is active without a sequence-parallel group (set_sequence_parallel)")
    groups = getattr(module, "num_key_value_groups", 1)
    if key.shape[1] % p:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        groups = 1
    q, k, v = (_heads_to_sequence(t, p, group) for t in (query, key, value))
    shim = types.SimpleNamespace(num_key_value_groups=groups, training=module.training, is_causal=True,
                                 layer_idx=getattr(module, "layer_idx", 0))
    base = getattr(module.config, _BASE_ATTR, "eager")
    s = q.shape[2]
    if base == "eager":
        mask = torch.full((s, s), torch.finfo(q.dtype).min, dtype=q.dtype).triu(1)[None, None]
        out, _ = eager_attention_forward(shim, q, k, v, mask, dropout=dropout, scaling=scaling)  # type: ignore[arg-type]
    else:
        out, _ = sdpa_attention_forward(shim, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)  # type: ignore[arg-type]
    return _sequence_to_heads(out, p, group), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES, ulysses_attention)


_register()


def shard_batch(batch: dict[str, torch.Tensor], sp: int, sp_rank: int) -> dict[str, torch.Tensor]:
    """This sp rank's part of a micro-batch from `train_step.batch_tensors` (all [B, T]).

    Returns input_ids/position_ids [B, n] of positions [a, b) (n = ceil(T/sp)), `labels` [B, n]
    (the token after each position), and loss_mask / behaviour_logprobs (and any other [B, T]
    float field) at positions [a+1, b+1), zero-padded; `advantages` [B] unchanged.
    """
    ids = batch["input_ids"]
    b, t = ids.shape
    n = -(-t // sp)
    start, end = sp_rank * n, (sp_rank + 1) * n

    def window(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        x = F.pad(x, (0, max(0, sp * n + 1 - t)))
        return x[:, lo:hi]

    out = {"input_ids": window(ids, start, end),
           "position_ids": torch.arange(start, end).unsqueeze(0).expand(b, n),
           "labels": window(ids, start + 1, end + 1)}
    for k, v in batch.items():
        if k in out or k in ("attention_mask",):
            continue
        out[k] = v if v.dim() == 1 else window(v, start + 1, end + 1)
    return out


def sp_windows(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int], sp: int,
               sp_rank: int) -> list[tuple[int, int]]:
    """(start a, tokens n) of this sp rank in each micro-batch: the micro-batch is padded to its longest
    row rounded up to a multiple of sp, and rank r runs positions [r n, (r + 1) n)."""
    out = []
    for mb in micro_batches:
        n = -(-max(lengths[i] for i in mb) // sp)
        out.append((sp_rank * n, n))
    return out


def sp_token_ranges(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int],
                    windows: Sequence[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
    """Row -> the [start, end) token range this sp rank pulls from the store: its positions [a, a+n)
    plus the next token (its last position's label), clipped to the row (possibly empty)."""
    ranges = {}
    for mb, (a, n) in zip(micro_batches, windows):
        for i in mb:
            ranges[i] = [(min(a, lengths[i]), min(a + n + 1, lengths[i]))]
    return ranges


def local_batch(rows: Sequence[dict[str, np.ndarray]], advantages: np.ndarray, window: tuple[int, int]) -> dict[str, torch.Tensor]:
    """This sp rank's part of a micro-batch from rows pulled with `sp_token_ranges` (each field holds
    the row's tokens [a, min(a + n + 1, length))): the same tensors as `shard_batch` of the whole
    micro-batch, without pulling or padding the other ranks' tokens."""
    a, n = window
    b = len(rows)
    ids = torch.zeros(b, n + 1, dtype=torch.long)
    mask = torch.zeros(b, n + 1, dtype=torch.float32)
    blp = torch.zeros(b, n + 1, dtype=torch.float32)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.from_numpy(r["input_ids"].astype(np.int64))
        mask[i, :k] = torch.from_numpy(r["loss_mask"].astype(np.float32))
        blp[i, :k] = torch.from_numpy(r["behaviour_logprobs"])
    return {"input_ids": ids[:, :n], "position_ids": torch.arange(a, a + n).unsqueeze(0).expand(b, n),
            "labels": ids[:, 1:], "loss_mask": mask[:, 1:], "behaviour_logprobs": blp[:, 1:],
            "advantages": torch.from_numpy(np.asarray(advantages, dtype=np.float32))}


def agree_on_lost(metas: Sequence[Any], pulled: dict[int, Any], lost: list[str]) -> tuple[dict[int, Any], list[str]]:
    """Drop on every rank the rows any rank lost (one MAX all-reduce of a flag per claimed row).

    The ranks of an sp group run collectives per micro-batch, so they must run the same rows even
    when a producer died between their pulls.
    """
    index = {m.sample_id: i for i, m in enumerate(metas)}
    flags = torch.zeros(len(metas), dtype=torch.int32)
    for sid in lost:
        flags[index[sid]] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    gone = {i for i in range(len(metas)) if flags[i]}
    return {i: r for i, r in pulled.items() if i not in gone}, [metas[i].sample_id for i in sorted(gone)]


def forward_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, n, V], log-probs [B, n] float32) aligned with the batch's loss tensors.

    A full batch (no "labels"): the model's logits and `algo.grpo.token_logprobs` (position t holds
    log p(token t | < t), position 0 gets 0). A `shard_batch` part: position i holds log p(labels[i]).
    """
    from earl_stream.algo.grpo import token_logprobs

    if "labels" not in batch:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits, token_logprobs(logits, batch["input_ids"])
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    return logits, logp


def entropy(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, n, V] -> [B, n] next-token entropy (nats), aligned like `forward_logprobs`."""
    from earl_stream.algo.grpo import token_entropy

    if "labels" not in batch:
        return token_entropy(logits)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def sp_state() -> tuple[int, int]:
    """(sp size, rank within the sp group) currently in force on this process."""
    return _STATE.size, _STATE.rank
