"""Bench-only hooks of bench/real_scale.py, run by Python's `site` module in every process of a run that
the harness starts (it puts this directory first on PYTHONPATH). It does nothing unless its variable is set:

- EARL_BENCH_RANK_CAP_BYTES: a trainer rank (RANK in its environment) is capped at this many bytes before it
  imports anything heavy. EARL_BENCH_CAP_MODE=cgroup (default, needs root and cgroup v1/v2 memory): it moves
  itself into a memory cgroup of its own (`earl_rs_<tag>_<pid>`, swap off) whose limit is the cap; past it the
  kernel OOM-kills the rank. EARL_BENCH_CAP_MODE=rlimit: setrlimit(RLIMIT_DATA) (a private writable address
  space cap: torch raises "can't allocate memory", the rank exits with the error).

- EARL_BENCH_MAX_MICRO_BATCH_TOKENS: every process but the trainer ranks (the supervisor is the one that plans)
  gives the trainer selector this largest micro-batch (`TrainerSelector(max_micro_batch_tokens=...)`, which no
  config field sets): the token cap of verl-style dynamic batching, micro-batches filled up to it, that the
  harness found for a static plan (or for the dynamic sequence-parallel arm's fixed plan).

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


def _cap_micro_batches(tokens: int) -> None:
    import functools

    from earl_stream.supervisor import selector

    init = selector.TrainerSelector.__init__

    @functools.wraps(init)
    def capped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **{**kwargs, "max_micro_batch_tokens": tokens})

    selector.TrainerSelector.__init__ = capped  # type: ignore[method-assign]


if _CAP and os.environ.get("RANK") is not None:
    _cap_rank(int(_CAP))
if os.environ.get("EARL_BENCH_MAX_MICRO_BATCH_TOKENS") and os.environ.get("RANK") is None:
    _cap_micro_batches(int(os.environ["EARL_BENCH_MAX_MICRO_BATCH_TOKENS"]))
