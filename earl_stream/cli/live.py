"""The live view of `earl-stream up`: a compact terminal dashboard (rich) on a terminal, plain log
lines every few seconds otherwise, and a closing summary. The learning curve is drawn from the per-step
record the supervisor writes (`cli/run_files.py`), not from what the view happened to see.

The view only reads the supervisor's status dictionary (the same JSON `earl-stream status --json`
prints), so what it shows is what any other client of the run can see.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from earl_stream.config import RunConfig

log = logging.getLogger(__name__)


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def status_line(s: dict[str, Any], steps: int) -> str:
    """The whole status in one line (plain output and `earl-stream status`)."""
    total = f"/{steps}" if steps else ""
    alive = sum(1 for w in s.get("workers", []) if w["alive"] and w["role"] == "rollout")
    ctx = s.get("context_length", {})
    return (f"step {s.get('policy_version', 0)}{total} | reward {_fmt(s.get('mean_reward_last'))} "
            f"| win {_fmt(s.get('win_rate_last'), '.2f')} draw {_fmt(s.get('draw_rate_last'), '.2f')} "
            f"| {s.get('tokens_per_second', 0):.0f} tok/s | store {s.get('samples_in_store', 0)} samples "
            f"| ctx p50 {_fmt(ctx.get('p50'), '.0f')} p99 {_fmt(ctx.get('p99'), '.0f')} "
            f"| plan {_plan_text(s)} | rollout workers {alive} | trained {s.get('samples_consumed', 0)} "
            f"lost {s.get('samples_lost', 0)}{_eval_text(s)}")


def _eval_text(s: dict[str, Any]) -> str:
    """' | held-out ENV SUCCESS@vVERSION ...' for the evaluated environments with a finished round (eval.every)."""
    done = [f"{env} {e['value']:.3f}@v{e['version']}" for env, e in (s.get("eval") or {}).items()
            if e.get("value") is not None]
    return f" | held-out {' '.join(done)}" if done else ""


def _game_text(e: dict[str, Any]) -> str:
    """' (win W draw D loss L)' for a game's evaluation point; '' for other environments."""
    if e.get("win_rate") is None:
        return ""
    return f" (win {e['win_rate']:.2f} draw {e['draw_rate']:.2f} loss {e['loss_rate']:.2f})"


def _plan_text(s: dict[str, Any]) -> str:
    plan = (s.get("plans") or {}).get("trainer")
    if not plan:
        return "selector off"
    name = f" {plan['name']}" if plan.get("name") else ""  # e.g. fsdp2_sp2 (status of an older supervisor: none)
    return f"v{plan['version']}{name} ({plan['design_seq_len']} tok, mb {plan['micro_batch_tokens']})"


def _bar(fraction: float | None, width: int = 24) -> ProgressBar:
    done = 0.0 if fraction is None else min(max(fraction, 0.0), 1.0)
    return ProgressBar(total=1.0, completed=done, width=width)


def dashboard(s: dict[str, Any], steps: int) -> Group:
    """The rich renderable of one status: progress, learning, throughput, plan, store, workers."""
    version = s.get("policy_version", 0)
    top = Table.grid(padding=(0, 1))
    top.add_column(style="bold", min_width=10)
    top.add_column()
    top.add_column()
    step_text = f"{version}/{steps}" if steps else f"{version} (until stopped)"
    top.add_row("step", _bar(version / steps if steps else None), step_text)
    reward = s.get("mean_reward_last")
    top.add_row("reward", _bar(None if reward is None else (reward + 1) / 2), _fmt(reward))  # rewards in [-1, 1]
    win = s.get("win_rate_last")
    top.add_row("win rate", _bar(win), f"{_fmt(win, '.2f')} (draw {_fmt(s.get('draw_rate_last'), '.2f')})")
    for env, e in (s.get("eval") or {}).items():  # evaluation during training (eval.every)
        if e.get("value") is not None:
            top.add_row("held-out", _bar(e["value"]),
                        f"{env} success {e['value']:.3f}{_game_text(e)} at version {e['version']}")
    ctx = s.get("context_length", {})
    trainer = s.get("trainer") or {}
    facts = Table.grid(padding=(0, 2))
    facts.add_row(
        f"[bold]throughput[/] {s.get('tokens_per_second', 0):.0f} tok/s",
        f"[bold]context[/] p50 {_fmt(ctx.get('p50'), '.0f')} p99 {_fmt(ctx.get('p99'), '.0f')} "
        f"max {_fmt(ctx.get('max'), '.0f')}",
        f"[bold]plan[/] {_plan_text(s)}")
    facts.add_row(
        f"[bold]store[/] {s.get('samples_in_store', 0)} waiting",
        f"[bold]samples[/] {s.get('samples_produced', 0)} produced, {s.get('samples_consumed', 0)} trained, "
        f"{s.get('samples_lost', 0)} lost, {s.get('samples_stale', 0)} stale",
        f"[bold]loss[/] {_fmt(trainer.get('loss'), '.4f')}  [bold]step[/] {_fmt(trainer.get('step_seconds'), '.2f')}s")
    workers = Table(box=None, padding=(0, 2), show_edge=False, header_style="bold")
    for col in ("worker", "role", "health", "seen", "detail"):
        workers.add_column(col)
    for w in s.get("workers", []):
        stats = w.get("stats") or {}
        if w["role"] == "rollout":
            detail = (f"{int(stats.get('episodes', 0))} episodes, {int(stats.get('inflight', 0))} in flight, "
                      f"{w.get('groups_held', 0)} groups held")
        else:
            detail = f"rank {w.get('rank', 0)}"
        health = "[green]alive[/]" if w["alive"] else "[red]dead[/]"
        workers.add_row(w["id"], w["role"], health, f"{w.get('last_seen_s', 0):.1f}s ago", detail)
    return Group(top, facts, workers)


class LiveView:
    """Shows a run while `up` waits on it."""

    def __init__(self, cfg: RunConfig) -> None:
        self.steps = cfg.steps
        self.tty = sys.stdout.isatty()
        self.console = Console()
        self._live: Live | None = None
        self._last_plain = 0.0

    def __enter__(self) -> LiveView:
        if self.tty:
            self._live = Live(Text("starting…"), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def message(self, text: str) -> None:
        # soft_wrap: a printed command must stay one line when copied from the terminal; no markup in paths
        self.console.print(text, soft_wrap=True, markup=False, highlight=False) if self.tty else print(text, flush=True)

    def update(self, status: dict[str, Any]) -> None:
        if not status:
            return
        if self._live is not None:
            self._live.update(dashboard(status, self.steps))
        elif time.monotonic() - self._last_plain > 5:
            print(status_line(status, self.steps), flush=True)
            self._last_plain = time.monotonic()

    def finish(self, summary: dict[str, Any], reason: str) -> None:
        head = f"stopped ({reason})" if reason else "done"
        self.message(f"{head}: {summary['steps']} steps in {summary['wall_seconds']:.0f}s, "
                     f"{summary['samples_trained']} samples trained of {summary['samples_produced']} produced, "
                     f"win rate {_fmt(summary['win_rate_last'], '.2f')}, mean reward {_fmt(summary['mean_reward_last'])}, "
                     f"{summary['tokens_per_second']:.0f} tok/s")
        for env, e in (summary.get("eval") or {}).items():
            if e.get("value") is not None:
                passk = " ".join(f"pass@{k} {v:.3f}" for k, v in e["pass_at_k"].items())
                self.message(f"held-out {env} at version {e['version']}: success {e['value']:.3f} "
                             f"+- {e['stderr']:.3f}{_game_text(e)}, {passk}, mean reward {e['mean_reward']:.3f} "
                             f"({len(e['history'])} evaluations)")
