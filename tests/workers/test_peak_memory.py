"""A rank's step peak (workers/peak_memory.py): what a step allocates beyond the bare process, reset per step."""

from __future__ import annotations

import sys

import pytest
import torch

from earl_stream.workers.peak_memory import PeakMemory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_cpu_step_peak_counts_what_the_step_allocated_and_resets() -> None:
    peak = PeakMemory(torch.device("cpu"))
    peak.start()
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched
    first = peak.step_peak()
    del big
    peak.start()
    small = torch.ones(1 << 20, dtype=torch.uint8)
    second = peak.step_peak()
    del small
    assert first >= 64 << 20
    assert second < first - (32 << 20)  # the reset forgot the earlier step's peak
