"""Consumer layouts and the pure partition function of a claimed batch.

Owns `Layout` (a rank's place in its pool's data x context x tensor parallel mesh) and `partition`,
which maps the claimed rows' lengths plus a layout to the rows, micro-batches and token ranges that
rank must pull. `partition` is a pure, deterministic function of its arguments: every rank computes
it from the same claimed metadata (in claim order), so no one has to send the answer.

The micro-batch budget has one definition, `materialised_tokens`: the tokens a micro-batch
materialises (packed: its concatenated length with the alignment padding to a multiple of sp;
unpacked: rows x longest row). The plan, this packer and the memory model's b x s share it.

Balance guarantee (data parallel): rows go longest-cost first to the least-loaded dp rank (Graham's
LPT). Its makespan is at most (4/3 - 1/(3*dp)) * OPT, and at most total/dp + (largest row cost)
(list scheduling). It is NOT always within 4/3 of the simple lower bound max(total/dp, max row):
four equal rows on three ranks give makespan 2 against a bound of 4/3 (OPT is 2 there too).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from earl_stream.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sizes and ranks of data parallel (dp), tensor parallel (tp) and context parallel (cp)."""

    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0

    def __post_init__(self) -> None:
        problems = []
        for axis in ("dp", "tp", "cp"):
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if not isinstance(size, int) or size < 1:
                problems.append(f"{axis}_size={size!r} must be an int >= 1")
            elif not isinstance(rank, int) or not 0 <= rank < size:
                problems.append(f"{axis}_rank={rank!r} must be an int in [0, {size})")
        if problems:
            raise ConfigError("invalid layout: " + "; ".join(problems))

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size * self.cp_size

    @property
    def rank(self) -> int:
        """Global rank in (dp, cp, tp) order, tp innermost (inverse of `from_rank`)."""
        return (self.dp_rank * self.cp_size + self.cp_rank) * self.tp_size + self.tp_rank

    @classmethod
    def from_rank(cls, rank: int, dp: int = 1, tp: int = 1, cp: int = 1) -> Layout:
        """Layout of global `rank` in a dp x cp x tp mesh ordered (dp, cp, tp), tp innermost."""
        world = dp * tp * cp
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} outside a world of {world} (dp={dp} x cp={cp} x tp={tp})")
        tp_rank = rank % tp
        cp_rank = (rank // tp) % cp
        dp_rank = rank // (tp * cp)
        return cls(dp_size=dp, dp_rank=dp_rank, tp_size=tp, tp_rank=tp_rank, cp_size=cp, cp_rank=cp_rank)


@dataclasses.dataclass(frozen=True)
class Partition:
    """One rank's share of a claimed batch.

    `rows`: indices into the claim (ascending); `micro_batches`: those rows grouped under the token
    budget; `token_ranges`: row -> [start, end) element ranges this rank needs (the whole row when
    cp_size == 1; two zig-zag chunks, possibly empty, when cp_size > 1); `dp_loads`: cost per dp rank;
    `max_micro_batches`: the largest micro-batch count of any dp rank (ranks that must step together,
    e.g. under FSDP, run that many passes).
    """

    rows: list[int]
    micro_batches: list[list[int]]
    token_ranges: dict[int, list[tuple[int, int]]]
    dp_loads: tuple[float, ...]
    max_micro_batches: int

    def ranges_by_position(self) -> dict[int, list[tuple[int, int]]]:
        """`token_ranges` keyed by position in `rows` (what `pull_samples` takes for `[claim[i] for i in rows]`)."""
        return {pos: self.token_ranges[row] for pos, row in enumerate(self.rows)}


def row_cost(length: int, quadratic_weight: float = 0.0) -> float:
    """Cost of one row: tokens + quadratic_weight * tokens^2 (attention-dominated rows cost more)."""
    return length + quadratic_weight * float(length) * float(length)


def assign_dp(lengths: Sequence[int], dp_size: int, quadratic_weight: float = 0.0) -> tuple[list[list[int]], list[float]]:
    """Greedy LPT: rows by cost descending (ties by index) to the least-loaded rank (ties by rank).

    Returns (rows per dp rank, ascending; load per dp rank).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-row_cost(lengths[i], quadratic_weight), i))
    heap = [(0.0, r) for r in range(dp_size)]
    assigned: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0.0] * dp_size
    for i in order:
        load, r = heapq.heappop(heap)
        assigned[r].append(i)
        loads[r] = load + row_cost(lengths[i], quadratic_weight)
        heapq.heappush(heap, (loads[r], r))
    return [sorted(rows) for rows in assigned], loads


def zigzag_ranges(length: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """Causal load-balanced split: 2*cp chunks, rank r gets chunks r and 2*cp-1-r (possibly empty)."""
    if cp_size == 1:
        return [(0, length)]
    n = 2 * cp_size
    bounds = [(i * length) // n for i in range(n + 1)]
    first, second = cp_rank, n - 1 - cp_rank
    return [(bounds[first], bounds[first + 1]), (bounds[second], bounds[second + 1])]


def materialised_tokens(lengths: Sequence[int], sp: int = 1, *, packed: bool = True) -> int:
    """The one definition of a micro-batch's size: tokens it materialises over its sp ranks.

    Packed (rows concatenated into one [1, S] sequence): S = sum(lengths) rounded up to a multiple of
    sp (the alignment padding is counted). Unpacked (rows right-padded into [B, W]): B x W, W = the
    longest row rounded up to a multiple of sp. Always a multiple of sp; one sp rank holds 1/sp of it.
    The plan's `micro_batch_tokens`, `partition`'s bins and the memory model's b x s all mean this.
    """
    if not lengths:
        return 0
    if packed:
        return -(-sum(lengths) // sp) * sp
    return len(lengths) * -(-max(lengths) // sp) * sp


def pack_micro_batches(rows: Sequence[int], lengths: Sequence[int], budget: int | None, *, sp: int = 1,
                       packed: bool = True) -> list[list[int]]:
    """First-fit decreasing of rows (of `lengths[row]` tokens) into micro-batches that each materialise
    at most `budget` tokens per sp rank (`materialised_tokens(...) // sp <= budget`).

    A row longer than the budget gets a micro-batch of its own (never dropped). Each micro-batch lists
    its rows ascending; micro-batches are ordered by their first row.
    """
    if not rows:
        return []
    if budget is None:
        return [sorted(rows)]
    bins: list[list[int]] = []
    total: list[int] = []  # summed lengths of each bin (packed)
    longest: list[int] = []  # its first row's length: rows arrive longest first (unpacked)

    def fits(b: int, n: int) -> bool:
        size = [total[b] + n] if packed else [longest[b]] * (len(bins[b]) + 1)
        return materialised_tokens(size, sp, packed=packed) // sp <= budget

    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        n = lengths[row]
        for b in range(len(bins)):
            if fits(b, n):
                bins[b].append(row)
                total[b] += n
                break
        else:
            bins.append([row])
            total.append(n)
            longest.append(n)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def partition(
    lengths: Sequence[int],
    layout: Layout,
    *,
    micro_batch_tokens: int | None = None,
    quadratic_weight: float = 0.0,
    packed: bool = True,
) -> Partition:
    """This rank's rows, micro-batches and token ranges of a claim with row `lengths` (tokens).

    `micro_batch_tokens` bounds the tokens one cp rank materialises per micro-batch:
    `materialised_tokens(rows, cp_size, packed=packed) // cp_size` (packed: the concatenated rows with
    their alignment padding; unpacked: rows x longest row), so that every cp rank of a group forms
    the same micro-batches.
    """
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ConfigError("row lengths must be >= 0 tokens")
    if micro_batch_tokens is not None and micro_batch_tokens < 1:
        raise ConfigError(f"micro_batch_tokens={micro_batch_tokens} must be >= 1 or None")
    if quadratic_weight < 0:
        raise ConfigError(f"quadratic_weight={quadratic_weight} must be >= 0")
    per_rank, loads = assign_dp(lengths, layout.dp_size, quadratic_weight)
    cp = layout.cp_size
    all_mbs = [pack_micro_batches(rows, lengths, micro_batch_tokens, sp=cp, packed=packed) for rows in per_rank]
    rows = per_rank[layout.dp_rank]
    return Partition(
        rows=rows,
        micro_batches=all_mbs[layout.dp_rank],
        token_ranges={row: zigzag_ranges(lengths[row], cp, layout.cp_rank) for row in rows},
        dp_loads=tuple(loads),
        max_micro_batches=max(len(m) for m in all_mbs),
    )
