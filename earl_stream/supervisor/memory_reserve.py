"""The trainer selector's memory reserve per layout, learnt from the ranks' reported peaks.

Owns `LearntReserve`: for each layout (by `selector.layout_name`: `dp2`, `fsdp2+rc`, ...) the excess of
the fullest rank's measured step peak (`peak_memory_bytes`) over what the selector predicted for that
step's micro-batches, and the reserve that layout's fit checks keep free from it. What a step was
predicted to take (the step's micro-batches, the calibration and correction factors in force) is the
selector's and the planner's business; this module only keeps the evidence and turns it into bytes.

The reserve of a layout is `prior + max(0, the largest excess of its last `window` measured steps)`:
- `prior` is `selector.reserve_bytes`, the reserve before any step of the layout was measured, and its
  floor afterwards: the peaks (CUDA's allocated high-water mark) do not see what it stands for (the CUDA
  context, the allocator's cached and fragmented blocks, communication buffers), so they can add to it
  but never show it to be smaller. A layout whose steps stay under their prediction keeps the prior.
- A windowed maximum, not a quantile: a step peak is not a noisy reading but an allocation that did
  happen, and the one step that went furthest past its prediction is the one that would crash the next
  time; a quantile would drop exactly that step at once. The window is counted in measured steps of the
  layout, not in time: an excess is forgotten only once `window` newer steps of the same layout were
  measured (more evidence replaced it), never because time passed, the pool ran other layouts or the
  supervisor restarted (the excesses are persisted with the planner's state). So a single outlier
  (a one-off allocation) costs memory for `window` steps of its layout, not for the rest of the run.
"""

from __future__ import annotations

from collections import deque

RESERVE_WINDOW_STEPS = 32  # measured steps per layout whose largest excess sets its reserve


class LearntReserve:
    """Bytes each layout's fit checks keep free: the prior, plus what its measured peaks exceeded the
    predictions by (see the module docstring)."""

    def __init__(self, prior_bytes: int, window: int = RESERVE_WINDOW_STEPS) -> None:
        if prior_bytes < 0 or window < 1:
            raise ValueError(f"prior_bytes={prior_bytes} must be >= 0 and window={window} >= 1")
        self.prior_bytes, self.window = prior_bytes, window
        self._excess: dict[str, deque[int]] = {}  # layout name -> excess bytes of its latest measured steps

    def observe(self, name: str, predicted_bytes: int, measured_bytes: int) -> int:
        """One measured step of layout `name`: its fullest rank peaked at `measured_bytes` where
        `predicted_bytes` were predicted. Returns the layout's reserve from now on."""
        self._excess.setdefault(name, deque(maxlen=self.window)).append(int(measured_bytes - predicted_bytes))
        return self.bytes(name)

    def bytes(self, name: str) -> int:
        """The reserve of layout `name` (the prior before any of its steps was measured)."""
        seen = self._excess.get(name)
        return self.prior_bytes + max(0, max(seen)) if seen else self.prior_bytes

    def excess(self) -> dict[str, list[int]]:
        """The evidence, oldest first per layout (what the planner persists)."""
        return {name: list(seen) for name, seen in self._excess.items()}

    def restore(self, excess: dict[str, list[int]]) -> None:
        """Continue from persisted evidence (`excess()` of an earlier run of the supervisor)."""
        for name, seen in excess.items():
            self._excess[name] = deque((int(x) for x in seen), maxlen=self.window)

    def status(self) -> dict[str, dict[str, int]]:
        """Per measured layout: its reserve, the largest excess it rests on, and over how many steps."""
        return {name: {"reserve_bytes": self.bytes(name), "max_excess_bytes": max(seen), "steps": len(seen),
                       "prior_bytes": self.prior_bytes}
                for name, seen in self._excess.items() if seen}
