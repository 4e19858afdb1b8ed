"""The live view of `earl-stream up`: one refreshing status line on a terminal (rich), plain log
lines every few seconds otherwise, and a closing summary."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from earl_stream.config import RunConfig

log = logging.getLogger(__name__)


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def status_line(s: dict[str, Any], steps: int) -> str:
    total = f"/{steps}" if steps else ""
    alive = sum(1 for w in s.get("workers", []) if w["alive"] and w["role"] == "rollout")
    ctx = s.get("context_length", {})
    return (f"step {s.get('policy_version', 0)}{total} | reward {_fmt(s.get('mean_reward_last'))} "
            f"| win {_fmt(s.get('win_rate_last'), '.2f')} draw {_fmt(s.get('draw_rate_last'), '.2f')} "
            f"| {s.get('tokens_per_second', 0):.0f} tok/s | store {s.get('samples_in_store', 0)} samples "
            f"| ctx p50 {_fmt(ctx.get('p50'), '.0f')} p99 {_fmt(ctx.get('p99'), '.0f')} "
            f"| plan v{(s.get('plans') or {}).get('trainer', {}) and s['plans']['trainer']['version'] or '-'}"
            f" ({_design(s)}) | rollout workers {alive} | trained {s.get('samples_consumed', 0)} "
            f"lost {s.get('samples_lost', 0)}")


def _design(s: dict[str, Any]) -> str:
    plan = (s.get("plans") or {}).get("trainer")
    return f"{plan['design_seq_len']} tok, mb {plan['micro_batch_tokens']}" if plan else "selector off"


class LiveView:
    def __init__(self, cfg: RunConfig) -> None:
        self.steps = cfg.steps
        self.tty = sys.stdout.isatty()
        self.console = Console()
        self._live: Live | None = None
        self._last_plain = 0.0

    def __enter__(self) -> "LiveView":
        if self.tty:
            self._live = Live(Text("starting…"), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def message(self, text: str) -> None:
        self.console.print(text) if self.tty else print(text, flush=True)

    def update(self, status: dict[str, Any]) -> None:
        if not status:
            return
        line = status_line(status, self.steps)
        if self._live is not None:
            self._live.update(Text(line))
        elif time.monotonic() - self._last_plain > 5:
            print(line, flush=True)
            self._last_plain = time.monotonic()

    def finish(self, summary: dict[str, Any], reason: str) -> None:
        head = f"stopped ({reason})" if reason else "done"
        lines = [f"{head}: {summary['steps']} steps in {summary['wall_seconds']:.0f}s, "
                 f"{summary['samples_trained']} samples trained of {summary['samples_produced']} produced, "
                 f"win rate {_fmt(summary['win_rate_last'], '.2f')}, mean reward {_fmt(summary['mean_reward_last'])}, "
                 f"{summary['tokens_per_second']:.0f} tok/s"]
        for line in lines:
            self.message(line)
