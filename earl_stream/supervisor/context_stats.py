"""Streaming context-length statistics: percentiles of episode length over a sliding window.

Owns: the window of the last `window` episodes' context lengths (total tokens per episode, from the
store's metadata rows), kept both in arrival order (to evict the oldest) and sorted (to read any
percentile in O(1)), and the immutable `ContextSnapshot` the selector and the metrics read.
Deciding what to do about a percentile is the selector's job; exporting it is the supervisor's.

Percentiles interpolate linearly between the two nearest ranks, as `numpy.percentile`'s default
("linear") does, so the status JSON and the selector agree with an offline numpy analysis.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
from collections import deque
from collections.abc import Iterable
from typing import Any


class Percentile(enum.Enum):
    """Which statistic of the window drives a decision."""

    P50 = "p50"
    P90 = "p90"
    P99 = "p99"
    MAX = "max"


@dataclasses.dataclass(frozen=True)
class ContextSnapshot:
    """Context length (tokens per episode) over the window at one moment.

    `count` is the number of episodes in the window (<= window); `total` counts every episode ever
    added (monotonic; the selector spaces re-plans by it). All lengths are 0 when `count` is 0.
    """

    p50: float
    p90: float
    p99: float
    max: int
    count: int
    total: int = 0

    def value(self, which: Percentile) -> float:
        """The statistic named by `which`, in tokens."""
        return float(self.max) if which is Percentile.MAX else float(getattr(self, which.value))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ContextSnapshot:
        return cls(p50=float(d["p50"]), p90=float(d["p90"]), p99=float(d["p99"]), max=int(d["max"]),
                   count=int(d["count"]), total=int(d.get("total", d["count"])))


class ContextStats:
    """Percentiles of the last `window` episode lengths; O(log n) search + O(n) memmove per add.

    A bisect-maintained list beats a balanced tree here: for n <= ~10k the memmove of `insort` and
    `pop` costs a few microseconds, and reads need random access by rank.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"context stats window must be >= 1 episode, got {window}")
        self.window = window
        self._arrivals: deque[int] = deque()
        self._sorted: list[int] = []
        self._total = 0

    def __len__(self) -> int:
        return len(self._sorted)

    @property
    def total(self) -> int:
        """Episodes ever added (including those that have left the window)."""
        return self._total

    def add(self, length: int) -> None:
        """Record one finished episode's context length (total tokens, >= 0)."""
        n = int(length)
        if n < 0 or n != length:
            raise ValueError(f"an episode's context length must be a whole number of tokens >= 0, got {length!r}")
        if len(self._arrivals) == self.window:
            old = self._arrivals.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._arrivals.append(n)
        bisect.insort(self._sorted, n)
        self._total += 1

    def add_many(self, lengths: Iterable[int]) -> None:
        for n in lengths:
            self.add(n)

    def values(self) -> list[int]:
        """The window in arrival order (oldest first): enough to persist and rebuild it with `add_many`."""
        return list(self._arrivals)

    def percentile(self, q: float) -> float:
        """The q-th percentile (0 <= q <= 100) of the window, numpy's linear interpolation; 0.0 if empty."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must be within [0, 100], got {q}")
        xs = self._sorted
        if not xs:
            return 0.0
        pos = (len(xs) - 1) * q / 100.0
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        frac = pos - lo
        a, b = float(xs[lo]), float(xs[hi])
        # numpy's _lerp: interpolate from the nearer end, so the result stays within [a, b]
        return a + (b - a) * frac if frac < 0.5 else b - (b - a) * (1.0 - frac)

    def snapshot(self) -> ContextSnapshot:
        return ContextSnapshot(p50=self.percentile(50), p90=self.percentile(90), p99=self.percentile(99),
                               max=self._sorted[-1] if self._sorted else 0, count=len(self._sorted),
                               total=self._total)
