"""Context-length statistics: sliding-window percentiles agree with numpy, eviction, persistence, speed."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from earl_stream.supervisor.context_stats import ContextSnapshot, ContextStats, Percentile


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(min_value=0, max_value=100_000), min_size=1, max_size=300),
       window=st.integers(min_value=1, max_value=120))
def test_percentiles_match_numpy_over_the_window(lengths: list[int], window: int) -> None:
    stats = ContextStats(window)
    stats.add_many(lengths)
    last = np.array(lengths[-window:], dtype=np.float64)
    snap = stats.snapshot()
    assert snap.count == len(last) and snap.total == len(lengths)
    for q, got in ((50, snap.p50), (90, snap.p90), (99, snap.p99)):
        assert got == pytest.approx(float(np.percentile(last, q)), rel=1e-12, abs=1e-9)
    assert snap.max == int(last.max())
    for q in (0, 12.5, 37, 75, 100):
        assert stats.percentile(q) == pytest.approx(float(np.percentile(last, q)), rel=1e-12, abs=1e-9)


def test_every_prefix_of_a_stream_matches_numpy() -> None:
    rng = random.Random(7)
    stats, seen = ContextStats(50), []
    for _ in range(400):
        n = int(rng.lognormvariate(7, 0.6))
        stats.add(n)
        seen.append(n)
        snap = stats.snapshot()
        assert snap.p99 == pytest.approx(np.percentile(seen[-50:], 99))
        assert snap.max == max(seen[-50:])


def test_empty_window_and_bad_input() -> None:
    stats = ContextStats(4)
    assert stats.snapshot() == ContextSnapshot(p50=0.0, p90=0.0, p99=0.0, max=0, count=0, total=0)
    with pytest.raises(ValueError, match="whole number of tokens"):
        stats.add(-1)
    with pytest.raises(ValueError, match="whole number of tokens"):
        stats.add(3.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        ContextStats(0)
    with pytest.raises(ValueError, match="percentile"):
        stats.percentile(101)


def test_eviction_persistence_and_snapshot_dict() -> None:
    stats = ContextStats(3)
    stats.add_many([100, 5, 7, 9])  # 100 leaves the window
    assert stats.values() == [5, 7, 9] and len(stats) == 3 and stats.total == 4
    snap = stats.snapshot()
    assert snap.max == 9 and snap.p50 == 7.0
    assert snap.value(Percentile.MAX) == 9.0 and snap.value(Percentile.P50) == 7.0
    again = ContextStats(3)
    again.add_many(stats.values())
    assert again.snapshot().p99 == snap.p99
    d = json.loads(json.dumps(snap.to_dict()))
    assert ContextSnapshot.from_dict(d) == snap


def test_a_full_window_of_10k_stays_cheap() -> None:
    rng = random.Random(1)
    stats = ContextStats(10_000)
    data = [rng.randrange(1, 32_768) for _ in range(40_000)]
    start = time.perf_counter()
    for n in data:
        stats.add(n)
    snap = stats.snapshot()
    per_add = (time.perf_counter() - start) / len(data)
    assert snap.count == 10_000 and snap.p90 == pytest.approx(np.percentile(data[-10_000:], 90))
    assert per_add < 50e-6, f"{per_add * 1e6:.1f} us per add"
