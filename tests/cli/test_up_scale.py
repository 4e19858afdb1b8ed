"""`up` follows the rollout pool size that `earl-stream scale` sets: it starts the workers the pool lacks
through its launcher, counts workers that are starting or draining right, and never revives a drained one."""

from __future__ import annotations

from typing import Any

from earl_stream.cli.up import scale_up


class FakePlaced:
    def __init__(self, name: str, code: int | None = None) -> None:
        self.name, self.code = name, code

    def poll(self) -> int | None:
        return self.code

    def describe_exit(self) -> str:
        return f"{self.name} exited with {self.code}"


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[int] = []

    def start_rollout_worker(self, index: int, address: str) -> FakePlaced:
        self.started.append(index)
        return FakePlaced(f"rollout worker {index}")


def _status(desired: int | None, active: int, draining: int = 0) -> dict[str, Any]:
    return {"pools": {"rollout": {"desired": desired, "active": active, "draining": draining, "drained": 0}}}


def test_scale_up_starts_what_the_pool_lacks() -> None:
    launcher = FakeLauncher()
    rollout: list[Any] = [FakePlaced("rollout worker 0"), FakePlaced("rollout worker 1")]
    assert scale_up(launcher, _status(None, 2), rollout, "tcp://x:1") == []  # never scaled: nothing to do
    new = scale_up(launcher, _status(4, 2), rollout, "tcp://x:1")
    assert [p.name for p in new] == ["rollout worker 2", "rollout worker 3"] and launcher.started == [2, 3]
    # the new ones have not registered yet (active 2): running children count, nothing more is started
    assert scale_up(launcher, _status(4, 2), rollout, "tcp://x:1") == []


def test_draining_and_drained_workers_are_not_replaced_too_early_or_revived() -> None:
    launcher = FakeLauncher()
    rollout: list[Any] = [FakePlaced("rollout worker 0"), FakePlaced("rollout worker 1"), FakePlaced("rollout worker 2")]
    assert scale_up(launcher, _status(2, 2, draining=1), rollout, "tcp://x:1") == []  # one drains: 2 remain
    rollout[2].code = 0  # it drained and left (exit 0)
    assert scale_up(launcher, _status(2, 2), rollout, "tcp://x:1") == [] and launcher.started == []
    # scaled up again later: one new worker, the drained one stays gone
    assert [p.name for p in scale_up(launcher, _status(3, 2), rollout, "tcp://x:1")] == ["rollout worker 3"]
