"""A trainer rank's peak memory over one step, in the units the memory model predicts.

On CUDA: the caching allocator's high-water mark of tensor bytes (`torch.cuda.max_memory_allocated`),
reset before each step. On CPU (Linux): the process's resident high-water mark (`VmHWM`, reset by writing
5 to /proc/self/clear_refs) minus its resident size before the model was loaded, so that the interpreter,
torch and the libraries (what the selector's reserve covers) are not counted as the model's. 0 where
neither can be read, and on a CPU host whose kernel ignores the reset (some sandboxes): a lifetime peak
would be taken for the step's. The supervisor takes the fullest rank's figure (`planning.Planner`) to calibrate
its memory model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RSS_SLACK = 32 << 20  # how far VmRSS/VmHWM may read from the truth (per-CPU counters, batched per CPU)


def _status_bytes(key: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


class PeakMemory:
    """Create it before the model is loaded (its CPU baseline); `start()` before a step, `step_peak()` after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0 if device.type == "cuda" else _status_bytes("VmRSS")
        self.resets = device.type == "cuda"  # whether the last start() reset the peak

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        before = _status_bytes("VmRSS")
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident size
        except OSError:
            self.resets = False  # not Linux, or not allowed
            return
        # a kernel that accepts the write but keeps the old mark (seen in CI sandboxes) leaves VmHWM above the
        # resident size; the larger of the sizes before and after, since other threads may free or touch pages,
        # and a slack for the kernel's per-CPU RSS counters, which /proc reads approximately on a host of many CPUs
        hwm, rss = _status_bytes("VmHWM"), max(before, _status_bytes("VmRSS"))
        self.resets = bool(hwm) and hwm <= rss + _RSS_SLACK
        if not self.resets:
            log.debug("VmHWM %d stayed above VmRSS %d after clear_refs: CPU step peaks are unknown", hwm, rss)

    def step_peak(self) -> int:
        """Bytes at the step's peak beyond the baseline (0: unknown)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if not self.resets:
            return 0
        peak = _status_bytes("VmHWM")
        return max(0, peak - self.baseline) if peak and self.baseline else 0
