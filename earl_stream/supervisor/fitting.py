"""Which training plans fit a per-device memory budget, and what would be needed when none does.

Owns: a plan's fit (`check_fit` -> `FitCheck`: the memory model's predicted peak against a budget and a
reserve), every variant of a plan that fits on a number of devices (`fitting_plans`: tp, sp, FSDP,
recomputation), and the advice for a plan that does not fit (`advise` -> `FitAdvice`: a plan on the same
devices that does, else the fewest devices or the smallest budget where one would). The predictions are
`memory_model`'s; ranking the plans that fit by speed is `cost_model`'s; when to reselect is the selector's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from earl_stream.supervisor.memory_model import GIB, MemoryBreakdown, ModelShape, Recompute, TrainPlan, predict_train_memory


@dataclasses.dataclass(frozen=True)
class FitCheck:
    """A plan's predicted peak against a per-device budget (reserve: runtime, allocator slack)."""

    plan: TrainPlan
    breakdown: MemoryBreakdown
    budget_bytes: int
    reserve_bytes: int = 0

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.reserve_bytes - self.breakdown.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0


@dataclasses.dataclass(frozen=True)
class FitAdvice:
    """Whether a plan fits, the plans on the same devices that do, and otherwise what would be needed."""

    check: FitCheck
    alternatives: tuple[FitCheck, ...]  # least recomputation first, then least model parallelism
    min_devices: int | None  # fewest devices (a power-of-two multiple, up to the limit) where a plan fits
    min_budget_bytes: int  # smallest per-device budget at which some plan on these devices fits
    message: str

    @property
    def fits(self) -> bool:
        return self.check.fits


_ALL_RECOMPUTES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


def check_fit(shape: ModelShape, plan: TrainPlan, budget_bytes: int, *, reserve_bytes: int = 0) -> FitCheck:
    return FitCheck(plan, predict_train_memory(shape, plan), budget_bytes, reserve_bytes)


def fitting_plans(shape: ModelShape, base: TrainPlan, devices: int, budget_bytes: int, *, reserve_bytes: int = 0,
                  recomputes: Sequence[Recompute] = _ALL_RECOMPUTES, allow_tp: bool = True,
                  allow_sp: bool = True) -> list[FitCheck]:
    """Every variant of `base` on exactly `devices` devices (tp, sp, fsdp, recompute) that fits: layouts the
    model can be split into (`ModelShape.layout_problems`), FSDP only over >= 2 data ranks (FSDP over the
    sp ranks alone is not a plan the trainer runs)."""
    pow2 = [1 << i for i in range(devices.bit_length()) if devices % (1 << i) == 0]
    out = []
    for tp in pow2 if allow_tp else [1]:
        for sp in [x for x in pow2 if (devices // tp) % x == 0] if allow_sp else [1]:
            if tp * sp > devices or shape.layout_problems(tp, sp) or base.seq_len % sp:
                continue
            dp = devices // (tp * sp)
            for fsdp in (False, True) if dp > 1 else (False,):
                for rc in recomputes:
                    plan = dataclasses.replace(base, tp=tp, sp=sp, dp=dp, fsdp=fsdp, recompute=rc,
                                               sequence_parallel=base.sequence_parallel and tp > 1)
                    fc = check_fit(shape, plan, budget_bytes, reserve_bytes=reserve_bytes)
                    if fc.fits:
                        out.append(fc)
    rank = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}
    out.sort(key=lambda f: (rank[f.plan.recompute], f.plan.tp * f.plan.sp, f.plan.fsdp, f.breakdown.total_bytes))
    return out


def advise(shape: ModelShape, plan: TrainPlan, budget_bytes: int, *, reserve_bytes: int = 0,
           recomputes: Sequence[Recompute] = _ALL_RECOMPUTES, allow_tp: bool = True, allow_sp: bool = True,
           max_devices: int = 4096) -> FitAdvice:
    """Check `plan` before it runs; if it does not fit, name a plan that does or what would be needed."""
    check = check_fit(shape, plan, budget_bytes, reserve_bytes=reserve_bytes)
    kw: dict[str, Any] = dict(reserve_bytes=reserve_bytes, recomputes=recomputes, allow_tp=allow_tp,
                              allow_sp=allow_sp)
    alts = fitting_plans(shape, plan, plan.devices, budget_bytes, **kw)
    unlimited = fitting_plans(shape, plan, plan.devices, 1 << 62, **kw)
    min_budget = reserve_bytes + min((f.breakdown.total_bytes for f in unlimited),
                                     default=check.breakdown.total_bytes)
    min_dev, example = (plan.devices, alts[0]) if alts else (None, None)
    devices = plan.devices * 2
    while min_dev is None and devices <= max_devices:
        found = fitting_plans(shape, plan, devices, budget_bytes, **kw)
        if found:
            min_dev, example = devices, found[0]
        devices *= 2
    need = (f"{plan.describe()} needs {(check.breakdown.total_bytes + reserve_bytes) / GIB:.2f} GiB per device "
            f"({check.breakdown.peak_phase.value} peak) of a {budget_bytes / GIB:.2f} GiB budget")
    if check.fits:
        msg = f"fits: {need}"
    elif alts:
        msg = f"does not fit: {need}; fits with {alts[0].plan.describe()}"
    else:
        more = (f"needs >= {min_dev} devices (e.g. {example.plan.describe()})" if example
                else f"no plan fits on up to {max_devices} devices")
        msg = (f"nothing fits on {plan.devices} device(s): {need}; {more}, "
               f"or a budget of >= {min_budget / GIB:.2f} GiB")
    return FitAdvice(check=check, alternatives=tuple(alts), min_devices=min_dev, min_budget_bytes=min_budget,
                     message=msg)
