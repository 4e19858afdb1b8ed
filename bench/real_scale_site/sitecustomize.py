"""Bench-only hooks of bench/real_scale.py, run by Python's `site` module in every process of a run that
the harness starts (it puts this directory first on PYTHONPATH). Each does nothing unless its variable is set:

- EARL_BENCH_RANK_CAP_BYTES: a trainer rank (RANK in its environment) is capped at this many bytes before it
  imports anything heavy. EARL_BENCH_CAP_MODE=cgroup (default, needs root and cgroup v1/v2 memory): it moves
  itself into a memory cgroup of its own (`earl_rs_<tag>_<pid>`, swap off) whose limit is the cap; past it the
  kernel OOM-kills the rank. EARL_BENCH_CAP_MODE=rlimit: setrlimit(RLIMIT_DATA) (a private writable address
  space cap: torch raises "can't allocate memory", the rank exits with the error).
- EARL_BENCH_FORCE_PLAN: in the supervisor, the trainer selector only considers the layouts named, '|'-separated
  (`dp2`, `fsdp2`, `tp2`, `sp2`, `fsdp2_sp2`, ...; `+rc` = full recomputation, without it none; e.g.
  `fsdp2+rc` or `dp2|sp2`). What the library lacks for this: a `selector.force_plan` (or `selector.plans`
  allow-list) field; today only allow_fsdp/allow_tp/allow_sp exist and recomputation cannot be pinned.
- EARL_BENCH_MIN_EPISODES: the selector's `Thresholds.min_episodes` (16 in the library, not a config field):
  with 2 episodes per training step the statistics would drive no plan for the first 8 steps.
"""

from __future__ import annotations

import os

_CAP = os.environ.get("EARL_BENCH_RANK_CAP_BYTES")
_FORCE = os.environ.get("EARL_BENCH_FORCE_PLAN")
_MIN_EPISODES = os.environ.get("EARL_BENCH_MIN_EPISODES")


def _cap_rank(cap: int) -> None:
    mode = os.environ.get("EARL_BENCH_CAP_MODE", "cgroup")
    if mode == "rlimit":
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
        return
    from pathlib import Path

    tag, pid = os.environ.get("EARL_BENCH_CAP_TAG", "run"), os.getpid()
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        group, limit, extra = v1 / f"earl_rs_{tag}_{pid}", "memory.limit_in_bytes", "memory.swappiness"
    else:
        group, limit, extra = Path("/sys/fs/cgroup") / f"earl_rs_{tag}_{pid}", "memory.max", "memory.swap.max"
    group.mkdir(exist_ok=True)
    (group / limit).write_text(str(cap))
    if (group / extra).exists():
        (group / extra).write_text("0")
    (group / "cgroup.procs").write_text(str(pid))


def _name(plan: object) -> str:
    p = plan  # a supervisor.memory_model.TrainPlan
    parts = [f"fsdp{p.dp}" if p.fsdp and p.dp > 1 else f"dp{p.dp}"] if p.dp > 1 else []  # type: ignore[attr-defined]
    parts += [f"{k}{getattr(p, k)}" for k in ("tp", "sp") if getattr(p, k) > 1]
    name = "_".join(parts) or "dp1"
    return name + ("+rc" if p.recompute.value == "full" else "")  # type: ignore[attr-defined]


def _patch_selector() -> None:
    import logging

    from earl_stream.supervisor import selector as S

    log = logging.getLogger("bench.real_scale_site")
    if _MIN_EPISODES:
        S.Thresholds.__dataclass_fields__["min_episodes"].default = int(_MIN_EPISODES)
        init = S.Thresholds.__init__
        defaults = list(init.__defaults__ or ())
        names = [f for f in S.Thresholds.__dataclass_fields__]
        defaults[names.index("min_episodes") - (len(names) - len(defaults))] = int(_MIN_EPISODES)
        init.__defaults__ = tuple(defaults)
    if _FORCE:
        wanted = set(_FORCE.split("|"))
        layouts = S.TrainerSelector.layouts

        def forced(self: S.TrainerSelector, design_seq_len: int) -> list:
            out = [p for p in layouts(self, design_seq_len) if _name(p) in wanted]
            if not out:
                why = "; ".join(f"{r.plan}: {r.reason}" for r in self.refused) or "no layout of that name"
                log.error("forced plan %s: no such layout for design length %d (%s)", _FORCE, design_seq_len, why)
            return out

        S.TrainerSelector.layouts = forced  # type: ignore[method-assign]


if _CAP and os.environ.get("RANK") is not None:
    _cap_rank(int(_CAP))
if _FORCE or _MIN_EPISODES:
    try:
        _patch_selector()
    except ImportError:
        pass  # a process without the project on its path
