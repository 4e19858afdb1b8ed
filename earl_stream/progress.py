"""Progress of a long command (model import and export, eval, sft, the benchmarks), always on stderr: a rich
bar on a terminal, a plain line at most every `interval_s` and one at the end in a pipe or a file, nothing
with EARL_STREAM_PROGRESS=off.

Owns how progress is shown and where: stderr, because stdout carries a command's result (its --json). What
a step is (an episode, an optimizer step, a file, a stage) is the caller's. Library code does not print: it
takes a `Report` callback, which a command passes as `Bar.update` of the bar it opened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console

__all__ = ["LINE_INTERVAL_S", "PROGRESS_ENV", "Bar", "Report", "progress", "progress_mode"]

PROGRESS_ENV = "EARL_STREAM_PROGRESS"  # auto (default: a bar on a terminal, lines elsewhere) | bar | lines | off
LINE_INTERVAL_S = 10.0  # a pipe gets a line at most this often (seconds), so a log stays readable

Report = Callable[[int, int, str], None]  # (steps done, steps in all, a short note such as the loss)

_OFF = ("off", "0", "false", "no")


def progress_mode(console: Console) -> str:
    """"bar", "lines" or "off": EARL_STREAM_PROGRESS, or by default a bar where `console` is a terminal."""
    wanted = os.environ.get(PROGRESS_ENV, "auto").strip().lower()
    if wanted in _OFF:
        return "off"
    if wanted in ("bar", "lines"):
        return wanted
    return "bar" if console.is_terminal else "lines"


class Bar:
    """The progress of one task: `advance` or `update` it; `progress` opens and closes it."""

    def __init__(self, description: str, total: int | None, unit: str, *, console: Console, mode: str,
                 interval_s: float) -> None:
        self.description, self.total, self.unit = description, total, unit
        self.done, self.note = 0, ""
        self._console, self._mode, self._interval_s = console, mode, interval_s
        self._started = self._last_line = time.monotonic()
        self._last_written: tuple[int, int | None, str] | None = None
        self._rich: Any = None
        self._moved: list[tuple[logging.StreamHandler[Any], Any]] = []  # (handler, its stream before the bar)
        if mode == "bar":
            self._rich = _rich_progress(console, unit)
            self._task = self._rich.add_task(description, total=total, note="")
            self._rich.start()
            self._move_log_handlers()

    def advance(self, n: int = 1, note: str | None = None) -> None:
        """`n` more steps done."""
        self.update(self.done + n, note=note)

    def update(self, done: int, total: int | None = None, note: str | None = None) -> None:
        """`done` steps done of `total` (unchanged when None); a `Report` callback."""
        self.done = done
        if total is not None:
            self.total = total
        if note is not None:
            self.note = note
        if self._rich is not None:
            self._rich.update(self._task, completed=done, total=self.total, note=self.note)
        elif self._mode == "lines" and time.monotonic() - self._last_line >= self._interval_s:
            self._write_line()

    def line(self) -> str:
        """The plain line of where the task stands, e.g. `eval: 40/100 episodes (40%) 12.3 s, loss 0.42`."""
        elapsed = time.monotonic() - self._started
        if self.total:
            count = f"{self.done}/{self.total} {self.unit} ({100 * self.done // self.total}%)"
        else:
            count = f"{self.done} {self.unit}"
        return f"{self.description}: {count} {elapsed:.1f} s" + (f", {self.note}" if self.note else "")

    def close(self, finished: bool) -> None:
        """Stop the bar, or write the last line (`stopped` when the task did not finish)."""
        if self._rich is not None:
            for handler, stream in self._moved:
                handler.setStream(stream)
            self._rich.stop()
        elif self._mode == "lines" and (not finished or self._last_written != (self.done, self.total, self.note)):
            self._write_line("" if finished else " (stopped)")

    def _move_log_handlers(self) -> None:
        """The root logger's handlers on stderr write through rich's stand-in for stderr while the bar is shown,
        so a log line is drawn above the bar instead of through it (they kept the stream of when they were made)."""
        real, proxy = self._console.file, sys.stderr
        if proxy is real:
            return
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is real:
                self._moved.append((handler, handler.setStream(proxy)))

    def _write_line(self, suffix: str = "") -> None:
        self._last_line, self._last_written = time.monotonic(), (self.done, self.total, self.note)
        self._console.file.write(self.line() + suffix + "\n")
        self._console.file.flush()


def _rich_progress(console: Console, unit: str) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    # what is written to stderr, or to stdout on the same terminal, is drawn above the bar; stdout to a pipe or a
    # file (a command's --json) is left alone
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                    TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[note]}"), console=console,
                    redirect_stdout=sys.stdout.isatty(), redirect_stderr=True)


@contextlib.contextmanager
def progress(description: str, total: int | None = None, unit: str = "items", *, console: Console | None = None,
             interval_s: float = LINE_INTERVAL_S) -> Iterator[Bar]:
    """A `Bar` of `total` steps (None: unknown until an `update` says) on stderr, or on `console`'s file."""
    console = console or Console(stderr=True)
    mode = progress_mode(console)
    restore = _quiet_transformers_bars() if mode != "off" else None
    bar = Bar(description, total, unit, console=console, mode=mode, interval_s=interval_s)
    finished = False
    try:
        yield bar
        finished = True
    finally:
        bar.close(finished)
        if restore is not None:
            restore()


def _quiet_transformers_bars() -> Callable[[], None] | None:
    """transformers' own tqdm bars (loading weights, writing shards) would draw through ours, and in a pipe add
    lines of carriage returns: off while ours is shown. Returns what turns them back on (None: nothing to do)."""
    hf = sys.modules.get("transformers.utils.logging")  # not imported here: a command that never loads it pays nothing
    if hf is None or not hf.is_progress_bar_enabled():
        return None
    hf.disable_progress_bar()
    return hf.enable_progress_bar
