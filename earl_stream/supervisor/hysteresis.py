"""What both pools' selectors share: a pool's memory budget (`PoolBudget`), the re-plan thresholds with
hysteresis (`Thresholds`), and `PoolSelector`: versions, hysteresis and the once-per-design-length report of
infeasibility. The trainer's selector is `selector.TrainerSelector`, the rollout engine's
`rollout_selector.RolloutSelector`; each answers `_plan` (which decision holds a design length) and
`_admissible` (whether a persisted decision still suits it).

Hysteresis: a plan is sized for a *design length* D = the next power of two >= headroom x the
observed percentile x. It is replaced when x > upper_factor x D (contexts outgrew it) or
x < lower_factor x D (it wastes memory), and not sooner than `min_episodes_between` episodes (and
`min_steps_between` steps) after the previous decision, unless x is past D itself: then waiting
would train past what the plan was sized for. Right after a decision D' lies in [h x, 2 h x), so x
sits inside (D'/(2h), D'/h]: `Thresholds` refuses factors for which that band would re-trigger.
A layout that cannot hold D but holds the headroom itself (h x, rounded up to `DESIGN_QUANTUM`) is
ranked at the longest length in [h x, D] it holds: the power of two is hysteresis, not a need, and a
faster plan is not given up for a few tokens of it. When not even h x fits any plan but x does, the
plan is sized for the longest design length in [x, h x) that fits (the headroom is given up before
the pool is left on a plan its contexts outgrew).

Everything is pure and deterministic: the same snapshots and steps give the same decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Generic, TypeVar

from earl_stream.errors import ConfigError
from earl_stream.supervisor.context_stats import ContextSnapshot, Percentile
from earl_stream.supervisor.decisions import Infeasible, PlanDecision, RolloutDecision

logger = logging.getLogger(__name__)
MIB = 1 << 20
DESIGN_QUANTUM = 64  # design lengths below the headroom's power of two (when it fits no plan): multiples of this


@dataclasses.dataclass(frozen=True)
class PoolBudget:
    """Devices of a pool (trainer) or of one engine (rollout), their memory, and what to keep free
    for what the memory model does not count (runtime, communication buffers, allocator slack)."""

    devices: int
    memory_bytes_per_device: int
    reserve_bytes: int = 0

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in ("devices", "memory_bytes_per_device") if getattr(self, k) < 1]
        if self.reserve_bytes < 0:
            bad.append(f"reserve_bytes={self.reserve_bytes}")
        if bad:
            raise ConfigError("invalid pool budget (devices and memory must be >= 1, reserve >= 0): " + ", ".join(bad))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When a pool re-plans (see the module docstring); lengths are tokens per episode."""

    percentile: Percentile = Percentile.P99
    upper_factor: float = 0.9
    lower_factor: float = 0.4
    headroom: float = 1.25
    min_episodes: int = 16  # episodes in the window before the statistics drive a plan
    min_episodes_between: int = 64
    min_steps_between: int = 0
    min_design_seq_len: int = 256
    max_design_seq_len: int = 0  # 0 = unbounded; else e.g. the model's max_position_embeddings

    def __post_init__(self) -> None:
        bad = []
        if not isinstance(self.percentile, Percentile):  # from a config file: "p99", "max", ...
            try:
                object.__setattr__(self, "percentile", Percentile(self.percentile))
            except ValueError:
                bad.append(f"percentile={self.percentile!r}; choose one of {[p.value for p in Percentile]}")
        if not 0 < self.lower_factor < self.upper_factor:
            bad.append(f"need 0 < lower_factor ({self.lower_factor}) < upper_factor ({self.upper_factor})")
        if self.headroom < 1:
            bad.append(f"headroom={self.headroom} must be >= 1")
        if self.upper_factor * self.headroom < 1:
            bad.append(f"upper_factor x headroom = {self.upper_factor * self.headroom:g} < 1 re-plans up at once")
        if self.lower_factor * 2 * self.headroom > 1:
            bad.append(f"lower_factor x 2 x headroom = {2 * self.lower_factor * self.headroom:g} > 1 "
                       "re-plans down at once")
        for k in ("min_episodes", "min_design_seq_len"):
            if getattr(self, k) < 1:
                bad.append(f"{k}={getattr(self, k)} must be >= 1")
        for k in ("min_episodes_between", "min_steps_between", "max_design_seq_len"):
            if getattr(self, k) < 0:
                bad.append(f"{k}={getattr(self, k)} must be >= 0")
        if 0 < self.max_design_seq_len < self.min_design_seq_len:
            bad.append(f"max_design_seq_len={self.max_design_seq_len} < min_design_seq_len={self.min_design_seq_len}")
        if bad:
            raise ConfigError("invalid selector thresholds: " + "; ".join(bad))

    def design_seq_len(self, observed: float) -> int:
        """The length a new plan is sized for: next power of two >= headroom x observed, clamped."""
        want = max(self.min_design_seq_len, math.ceil(observed * self.headroom))
        design = 1 << (want - 1).bit_length()
        return min(design, self.max_design_seq_len) if self.max_design_seq_len else design

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "percentile": self.percentile.value}


D = TypeVar("D", PlanDecision, RolloutDecision)


class PoolSelector(Generic[D]):
    """Hysteresis, versions and the once-per-design-length report of infeasibility, for both pools."""

    pool: str

    def __init__(self, budget: PoolBudget, thresholds: Thresholds | None, pool: str) -> None:
        self.budget, self.thresholds, self.pool = budget, thresholds or Thresholds(), pool
        self._current: D | None = None
        self._infeasible: Infeasible | None = None
        self._last: tuple[int, int] | None = None  # (episodes total, step) of the last decision
        self._snapshot: ContextSnapshot | None = None  # the statistics of the latest decide()
        self._ceiling: tuple[int, int] | None = None  # (headroom design that fits nothing, longest that fits)

    @property
    def current(self) -> D | None:
        return self._current

    @property
    def version(self) -> int:
        return self._current.version if self._current else 0

    def _plan(self, design: int, reason: str, step: int, floor: int = 0) -> D | Infeasible:
        """The decision for `design`; a layout that cannot hold it may be sized for any length in
        [floor, design) instead (0: design only)."""
        raise NotImplementedError

    def plan_for(self, design_seq_len: int, *, reason: str = "", step: int = 0) -> D | Infeasible:
        """What a decision for `design_seq_len` would be (as the next version); changes no state."""
        return self._plan(design_seq_len, reason or f"plan for design length {design_seq_len}", step)

    def initial(self, design_seq_len: int, *, step: int = 0) -> D | Infeasible:
        """Plan before any episode finished (e.g. for the prompt length the run starts with)."""
        reason = f"initial plan for design length {design_seq_len} (no episodes yet)"
        return self._adopt(self._plan(design_seq_len, reason, step), 0, step)

    def decide(self, snapshot: ContextSnapshot, step: int = 0) -> D | Infeasible | None:
        """A new decision when the thresholds are crossed, Infeasible once per unreachable design
        length (until a decision succeeds), otherwise None (keep the current plan)."""
        self._snapshot = snapshot
        hit, unfit = self._trigger(snapshot, step), self._unfit()
        if unfit is not None and self._current is not None:  # urgent: keep the design unless the thresholds move it
            design, why = hit or (self._current.design_seq_len, "")
            hit = design, f"{why}; {unfit}" if why else unfit
        if hit is None:
            return None
        design, reason = hit
        if self._infeasible is not None and self._infeasible.design_seq_len == design:
            return None
        observed, current = snapshot.value(self.thresholds.percentile), self._current
        if (unfit is None and current is not None and self._ceiling == (design, current.design_seq_len)
                and observed <= current.design_seq_len):
            return None  # the headroom design fits nothing and the current plan is already the longest that fits
        result = self._plan(design, reason, step, floor=self._floor(observed, design))
        if isinstance(result, Infeasible):
            result = self._without_headroom(observed, result, step)
            if (unfit is None and not isinstance(result, Infeasible) and self._current is not None
                    and result.design_seq_len == self._current.design_seq_len):
                self._ceiling = (design, result.design_seq_len)
                return None
        return self._adopt(result, snapshot.total, step)

    def _unfit(self) -> str | None:
        """Why the current plan no longer fits the memory it was chosen for (None: it fits)."""
        return None

    def _floor(self, observed: float, design: int) -> int:
        """The shortest design length that still keeps the headroom over `observed` (quantum multiples)."""
        th, q = self.thresholds, DESIGN_QUANTUM
        return min(design, max(th.min_design_seq_len, q * math.ceil(observed * th.headroom / q)))

    def _without_headroom(self, observed: float, failed: Infeasible, step: int) -> D | Infeasible:
        """The headroom design fits no plan: the longest design between the observed length and it that
        does (multiples of `DESIGN_QUANTUM` tokens, binary search), so that the pool keeps up with its
        contexts for as long as any plan can; `failed` when not even the observed length fits."""
        q = DESIGN_QUANTUM
        lo, hi = max(1, math.ceil(observed / q)), (failed.design_seq_len - 1) // q
        if lo > hi:
            return failed
        reason = (f"{failed.reason}, which fits no plan ({failed.message.split(': ', 1)[-1]}); "
                  "sized for the longest design length that fits instead")
        best = self._plan(lo * q, reason, step)
        if isinstance(best, Infeasible):
            return failed
        while lo < hi:
            mid = (lo + hi + 1) // 2
            trial = self._plan(mid * q, reason, step)
            if isinstance(trial, Infeasible):
                hi = mid - 1
            else:
                lo, best = mid, trial
        return best

    def restore(self, decision: D) -> None:
        """Continue from a persisted decision (e.g. after a supervisor restart)."""
        self._current, self._infeasible, self._last = decision, None, None

    def resume(self, saved: D) -> D:
        """Continue from a persisted decision so that versions never go back: kept if this selector
        could still make it (same pool and model, an allowed layout that fits), else the current
        (start-up) plan is renumbered to follow it."""
        fresh = self._current
        if fresh is None or self._admissible(saved):
            self.restore(saved)
            return saved
        logger.warning("%s: plan v%d of the earlier run does not suit this pool or model; continuing with %s",
                       self.pool, saved.version, fresh.reason)
        self.restore(dataclasses.replace(fresh, version=saved.version + 1,
                                         reason=f"resumed after plan v{saved.version} (not admissible here): "
                                                f"{fresh.reason}"))
        assert self._current is not None
        return self._current

    def _admissible(self, decision: D) -> bool:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "version": self.version,
                "current": self._current.to_dict() if self._current else None,
                "last_infeasible": self._infeasible.to_dict() if self._infeasible else None,
                "thresholds": self.thresholds.to_dict(), "budget": self.budget.to_dict()}

    def _trigger(self, snapshot: ContextSnapshot, step: int) -> tuple[int, str] | None:
        th = self.thresholds
        if snapshot.count < th.min_episodes:
            return None
        x, name = snapshot.value(th.percentile), th.percentile.value
        target, shown = th.design_seq_len(x), f"{x:.1f}".removesuffix(".0")
        if self._current is None:
            return target, (f"first plan: {name} context {shown} over {snapshot.count} episodes "
                            f"-> design length {target}")
        d = self._current.design_seq_len
        if x > th.upper_factor * d:
            reason, urgent = f"{name} context {shown} > {th.upper_factor:g} x {d} design length", x > d
        elif x < th.lower_factor * d:
            reason, urgent = f"{name} context {shown} < {th.lower_factor:g} x {d} design length", False
        else:
            return None
        if target == d:  # clamped by min/max_design_seq_len: nothing to change
            return None
        if self._last is not None and not urgent:
            total, last_step = self._last
            if snapshot.total - total < th.min_episodes_between or step - last_step < th.min_steps_between:
                return None
        return target, f"{reason} -> design length {target}"

    def _adopt(self, result: D | Infeasible, total: int, step: int) -> D | Infeasible:
        if isinstance(result, Infeasible):
            self._infeasible = result
            logger.warning("%s: no plan fits design length %d (%s): %s", self.pool, result.design_seq_len,
                           result.reason, result.message)
            return result
        self._current, self._infeasible, self._last = result, None, (total, step)
        logger.info("%s plan v%d at step %d: %s", self.pool, result.version, step, result.reason)
        return result
