"""A growth curriculum shared by the environments whose episodes get longer as a run goes on.

`Curriculum.level(seed, grow_every, key)` is the level of `seed`: the number of distinct seeds this
process had seen (under `key`) before it first saw `seed`, divided by `grow_every` (0 when
`grow_every` <= 0). A seed's level is fixed the first time the process sees it, so every member of a
GRPO group (same seed) gets the same episode and a seed replays exactly within a process; across
processes a level depends on how many seeds that process saw before. The levels of the most recent
4096 seeds are remembered; an older seed gets a fresh level.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["CURRICULUM", "Curriculum"]

_SEEDS_REMEMBERED = 4096


class Curriculum:
    """Process-wide: the level of each seed, by the order in which distinct seeds arrive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._levels: dict[Hashable, OrderedDict[int, int]] = {}
        self._seen: dict[Hashable, int] = {}

    def level(self, seed: int, grow_every: int, key: Hashable) -> int:
        """The level of `seed` among the seeds seen under `key` (one count per environment configuration)."""
        if grow_every <= 0:
            return 0
        with self._lock:
            levels = self._levels.setdefault(key, OrderedDict())
            if seed not in levels:
                levels[seed] = self._seen.get(key, 0) // grow_every
                self._seen[key] = self._seen.get(key, 0) + 1
                if len(levels) > _SEEDS_REMEMBERED:
                    levels.popitem(last=False)
            levels.move_to_end(seed)
            return levels[seed]


CURRICULUM = Curriculum()
