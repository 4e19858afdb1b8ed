"""Per-micro-batch dynamic sequence parallelism (`trainer.dynamic_sp_tokens`), in the manner of verl's
dynamic context parallelism.

The model's sharding stays the plan's (dpN or fsdpN: N data ranks, sp = 1, tp = 1); only the degree
of sequence parallelism is chosen per micro-batch, from its longest row. A row of more than
`dynamic_sp_tokens` tokens is *shared*: all N data ranks train it together as one micro-batch under
Ulysses sp = N over the whole pool (each holds a contiguous 1/N slice of the row's tokens, attention
all-to-alls over the N ranks; `workers.batches`' sp windows and token ranges), while the step's other
rows are partitioned over the data ranks as always and run at sp = 1 on their own ranks. Only the
degrees 1 and N are chosen (degrees in between would need groups of a size the plan does not make).

Owns the decision (`DynamicSp`: on or off for a placement, and why a placement cannot run it), the
shared micro-batches of an update (`shared_micro_batches`: one row each, in claim order, so that
every rank runs the same SP-N micro-batches in the same order, before its own ones; FSDP's gathers
and the all-to-alls then meet on every rank) and the sp state around one micro-batch
(`DynamicSp.around`). The math is unchanged: row weights come from the claim's global counts and
gradients are summed over the data ranks, so a row split over N ranks adds up to the row on one.
Which micro-batches a rank runs, and the loss, are `workers.train_step`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from earl_stream.errors import ConfigError
from earl_stream.workers.batches import rank_windows
from earl_stream.workers.mesh import Placement
from earl_stream.workers.tensor_parallel import family_problems
from earl_stream.workers.ulysses import set_sequence_parallel

FIELD = "trainer.dynamic_sp_tokens"


@dataclasses.dataclass(frozen=True)
class SharedMicroBatches:
    """The shared (sp = N) micro-batches of one update, as one rank runs them (indices into `lengths`)."""

    rows: list[int]  # the shared rows, ascending: every rank pulls its slice of each
    micro_batches: list[list[int]]  # one row each, in `rows`' order (the same on every rank)
    windows: list[tuple[int, int]]  # this rank's (start a, tokens n) in each
    ranges: dict[int, list[tuple[int, int]]]  # row -> the [start, end) token range this rank pulls


@dataclasses.dataclass(frozen=True)
class DynamicSp:
    """Dynamic sp of one placement: rows of more than `tokens` tokens run at sp `degree` (the data
    ranks, N) with this rank at sp rank `rank` (its data rank); `degree` 1 = off."""

    tokens: int = 0
    degree: int = 1
    rank: int = 0

    @property
    def on(self) -> bool:
        return self.degree > 1

    @classmethod
    def of(cls, tokens: int, placement: Placement, config: Any) -> DynamicSp:
        """The dynamic sp of `placement` for a model with HF `config`: off when `tokens` is 0, when the plan
        already runs sp > 1 or has one data rank. Raises ConfigError (naming `trainer.dynamic_sp_tokens`)
        where the placement cannot run it: tensor parallel, experts, heads that N does not divide, a model
        family whose attention Ulysses cannot replace."""
        plan = placement.plan
        if tokens <= 0 or plan.sp > 1:
            return cls()
        problems = []
        if plan.tp > 1:
            problems.append(f"plan {plan.name} is tensor parallel (tp={plan.tp}); dynamic sp runs on dpN / fsdpN "
                            "plans only (tensor-parallel plans are out of scope)")
        n = plan.data_ranks
        if n <= 1 and not problems:
            return cls()
        if plan.ep > 1 or getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
            problems.append("mixture-of-experts blocks are not sequence parallel in this version")
        heads = int(config.num_attention_heads)
        if n > 1 and heads % n:
            problems.append(f"sp={n} (the {n} data ranks of plan {plan.name}) does not divide the model's {heads} "
                            "attention heads")
        problems += family_problems(config, sp=max(2, n))
        if problems:
            raise ConfigError(f"{FIELD}={tokens}: " + "; ".join(problems) + f"; set {FIELD}=0 or change the plan")
        return cls(tokens=tokens, degree=n, rank=placement.layout.dp_rank)

    def shared(self, lengths: Sequence[int]) -> list[int]:
        """Indices of the rows (of `lengths` tokens) that run shared: longer than `tokens` (none when off)."""
        return [j for j, n in enumerate(lengths) if self.on and n > self.tokens]

    def micro_batches(self, lengths: Sequence[int], *, packed: bool) -> SharedMicroBatches:
        """The shared micro-batches of an update whose rows have `lengths` (one row each, ascending)."""
        rows = self.shared(lengths)
        mbs = [[j] for j in rows]
        if not mbs:
            return SharedMicroBatches(rows=[], micro_batches=[], windows=[], ranges={})
        windows, ranges = rank_windows(mbs, lengths, self.degree, self.rank, packed=packed)
        assert ranges is not None  # degree > 1
        return SharedMicroBatches(rows=rows, micro_batches=mbs, windows=windows, ranges=ranges)

    @contextlib.contextmanager
    def around(self, models: Iterable[Any], sp: int) -> Iterator[None]:
        """Ulysses at degree `sp` over the pool for the models while inside (a no-op at sp 1); then back to
        sp 1. Keep a micro-batch's forward and backward inside (recomputation re-runs attention), and
        enter it outside `packed_segments` (which keeps an implementation that is not the model's own).
        tp = sp = 1, so the data ranks are the whole pool: the group is WORLD, this rank's sp rank its
        data rank."""
        if sp <= 1:
            yield
            return
        models = list(models)
        assert dist.get_rank() == self.rank, "dynamic sp: the data ranks are the whole pool, in rank order"
        set_sequence_parallel(models, dist.group.WORLD, sp, self.rank)
        try:
            yield
        finally:
            set_sequence_parallel(models, None, 1, 0)
