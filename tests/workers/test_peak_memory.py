"""A rank's step peak (workers/peak_memory.py): what a step allocates beyond the bare process, reset per step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from earl_stream.workers import peak_memory
from earl_stream.workers.peak_memory import PeakMemory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_cpu_step_peak_counts_what_the_step_allocated_and_resets() -> None:
    # /proc reads RSS approximately (per-CPU counters: tens of MiB on a host of many CPUs, as seen in CI), so the
    # step allocates far more than that
    size, slack = 512 << 20, 64 << 20
    peak = PeakMemory(torch.device("cpu"))
    peak.start()
    reset_first = peak.resets
    at_start = peak_memory._status_bytes("VmRSS") - peak.baseline  # the process may have freed pages since
    big = torch.ones(size, dtype=torch.uint8)  # touched
    first = peak.step_peak()
    del big
    peak.start()
    reset_second = peak.resets
    held = peak_memory._status_bytes("VmRSS") - peak.baseline  # an allocator may keep the freed pages resident
    small = torch.ones(1 << 20, dtype=torch.uint8)
    second = peak.step_peak()
    del small
    # where the kernel kept the old mark, the step's peak is unknown (0), never the lifetime's
    if not reset_first:
        assert first == 0
    else:
        assert first >= at_start + size - slack
    if not reset_second:
        assert second == 0
    else:
        assert second <= max(held, 0) + slack  # the reset forgot the earlier step's peak beyond what is held
        if reset_first and held < slack:
            assert second < first - size // 2

def test_a_reset_the_kernel_ignores_reports_an_unknown_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ignored = tmp_path / "clear_refs"  # accepts the write, resets nothing
    ignored.write_text("")
    monkeypatch.setattr(peak_memory, "_CLEAR_REFS", ignored)
    peak = PeakMemory(torch.device("cpu"))
    big = torch.ones(256 << 20, dtype=torch.uint8)
    del big  # the lifetime mark is now 256 MiB above the resident size (unless the allocator kept the pages)
    peak.start()
    if peak_memory._status_bytes("VmHWM") <= peak_memory._status_bytes("VmRSS") + 2 * peak_memory._RSS_SLACK:
        pytest.skip("this process's resident size still holds its lifetime peak")
    assert not peak.resets
    assert peak.step_peak() == 0
