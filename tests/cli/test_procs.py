"""`ProcessGroup.stop` (cli/procs.py) as `up` uses it: a child with a grace of its own (the trainer, which
finishes its step and writes a checkpoint) is stopped first and given that grace before SIGKILL; the
others get the group's short one, and the first child (the supervisor) stops last."""

from __future__ import annotations

import time
from pathlib import Path

from earl_stream.cli.procs import ProcessGroup

# Stands in for `python -m earl_stream ...` (the group starts it behind this prefix): on SIGTERM it
# notes the time, takes `$1` seconds to finish, and exits 0.
SLOW_TO_STOP = ["bash", "-c", 'trap \'echo "$(date +%s.%N)" > "$2.term"; sleep "$1"; exit 0\' TERM; '
                'while :; do sleep 0.05; done']


def _child(group: ProcessGroup, tmp: Path, name: str, seconds: float, grace: float | None = None) -> None:
    group.start(name, [], prefix=[*SLOW_TO_STOP, "sh", str(seconds), str(tmp / name)], stop_grace_s=grace)


def test_a_child_with_its_own_grace_stops_first_and_is_given_its_grace(tmp_path: Path) -> None:
    group = ProcessGroup()
    _child(group, tmp_path, "supervisor", 0)
    _child(group, tmp_path, "rollout", 0)
    _child(group, tmp_path, "trainer", 2.0, grace=10.0)
    _child(group, tmp_path, "stuck", 5.0)
    time.sleep(0.5)  # the traps are set
    started = time.monotonic()
    group.stop(timeout_s=1.0)
    took = time.monotonic() - started
    codes = {c.name: c.proc.returncode for c in group.children}
    assert codes == {"supervisor": 0, "rollout": 0, "trainer": 0, "stuck": -9}, codes  # only `stuck` outlived its grace
    term = {c.name: float((tmp_path / f"{c.name}.term").read_text()) for c in group.children}
    assert term["trainer"] + 2.0 <= term["rollout"] + 0.1  # the others were signalled once the trainer was done
    assert abs(term["rollout"] - term["stuck"]) < 0.5 and term["stuck"] < term["supervisor"]
    print(f"stopped in {took:.1f}s")
    assert took < 6.0, took
