"""Bench-only hooks of bench/real_scale.py, run by Python's `site` module in every process of a run that
the harness starts (it puts this directory first on PYTHONPATH). It does nothing unless its variable is set:

- EARL_BENCH_RANK_CAP_BYTES: a trainer rank (RANK in its environment) is capped at this many bytes before it
  imports anything heavy. EARL_BENCH_CAP_MODE=cgroup (default, needs root and cgroup v1/v2 memory): it moves
  itself into a memory cgroup of its own (`earl_rs_<tag>_<pid>`, swap off) whose limit is the cap; past it the
  kernel OOM-kills the rank. EARL_BENCH_CAP_MODE=rlimit: setrlimit(RLIMIT_DATA) (a private writable address
  space cap: torch raises "can't allocate memory", the rank exits with the error).

Forcing a static plan and the selector's minimum of episodes are config fields (`selector.plans`,
`selector.min_episodes`), which the harness sets.
"""

from __future__ import annotations

import os

_CAP = os.environ.get("EARL_BENCH_RANK_CAP_BYTES")


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


if _CAP and os.environ.get("RANK") is not None:
    _cap_rank(int(_CAP))
