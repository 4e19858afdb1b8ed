"""Timing jitter for tests of timing independence (`EARL_STREAM_JITTER_MS`).

A test that claims a run does not depend on timing (the staleness-0 invariant) sets
`EARL_STREAM_JITTER_MS=N` in the processes it starts: every control-plane call (rollout workers, trainer
ranks) and every engine request of an episode then waits a random 0..N ms first, drawn from a generator of
its own (never the run's seeded ones), so that messages and batches meet in other orders each time. Unset
(users' runs), the functions return at once. It owns nothing else.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

ENV = "EARL_STREAM_JITTER_MS"  # the variable a test sets
_RNG = random.Random()  # seeded from the OS: the jitter must differ run to run and touch no seeded stream


def _max_ms() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV, "0") or 0))
    except ValueError:
        return 0.0


def jitter() -> None:
    """Sleep a random 0..EARL_STREAM_JITTER_MS ms (no-op when unset)."""
    if (ms := _max_ms()) > 0:
        time.sleep(_RNG.uniform(0, ms) / 1000)


async def ajitter() -> None:
    """`jitter` for coroutines (yields to the event loop while it waits)."""
    if (ms := _max_ms()) > 0:
        await asyncio.sleep(_RNG.uniform(0, ms) / 1000)
