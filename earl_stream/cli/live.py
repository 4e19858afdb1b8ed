"""The live view of `earl-stream up`: a compact terminal dashboard (rich) on a terminal, plain log
lines every few seconds otherwise, a closing summary, and the learning curve of the run.

The view only reads the supervisor's status dictionary (the same JSON `earl-stream status --json`
prints), so what it shows is what any other client of the run can see.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
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
            top.add_row("held-out", _bar(e["value"]), f"{env} success {e['value']:.3f} at version {e['version']}")
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


@dataclasses.dataclass
class CurvePoint:
    """One training step as the live view saw it."""

    step: int
    wall_seconds: float
    mean_reward: float | None
    win_rate: float | None
    draw_rate: float | None
    loss: float | None


class LiveView:
    """Shows a run while `up` waits on it and remembers its learning curve."""

    def __init__(self, cfg: RunConfig) -> None:
        self.steps = cfg.steps
        self.tty = sys.stdout.isatty()
        self.console = Console()
        self.curve: list[CurvePoint] = []
        self.eval: dict[str, Any] = {}  # status "eval": env -> latest round and its history (eval.every)
        self._live: Live | None = None
        self._last_plain = 0.0
        self._started = time.monotonic()

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
        self._record(status)
        self.eval = status.get("eval") or self.eval
        if self._live is not None:
            self._live.update(dashboard(status, self.steps))
        elif time.monotonic() - self._last_plain > 5:
            print(status_line(status, self.steps), flush=True)
            self._last_plain = time.monotonic()

    def _record(self, s: dict[str, Any]) -> None:
        step = int(s.get("policy_version", 0))
        if step == 0 or (self.curve and self.curve[-1].step >= step):
            return
        trainer = s.get("trainer") or {}
        self.curve.append(CurvePoint(step, time.monotonic() - self._started, s.get("mean_reward_last"),
                                     s.get("win_rate_last"), s.get("draw_rate_last"), trainer.get("loss")))

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
                             f"+- {e['stderr']:.3f}, {passk}, mean reward {e['mean_reward']:.3f} "
                             f"({len(e['history'])} evaluations)")

    def write_learning_curve(self, path: Path) -> Path | None:
        """Plot reward, win/draw rate and loss per step to `path` (PNG); None when nothing was trained."""
        if not self.curve:
            return None
        return plot_learning_curve(self.curve, path, self.eval)


def plot_learning_curve(points: list[CurvePoint], path: Path, evals: dict[str, Any] | None = None) -> Path:
    """Two panels over training steps: mean reward and win/draw rate (supervisor window) with the held-out
    success of each evaluated environment (status "eval", eval.every), and loss."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training host
    import matplotlib.pyplot as plt

    steps = [p.step for p in points]
    fig, (ax, ax_loss) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    for name, values in (("mean reward", [p.mean_reward for p in points]), ("win rate", [p.win_rate for p in points]),
                         ("draw rate", [p.draw_rate for p in points])):
        xs = [s for s, v in zip(steps, values) if v is not None]
        ax.plot(xs, [v for v in values if v is not None], label=name)
    for env, e in (evals or {}).items():
        history = [p for p in e.get("history", []) if p.get("value") is not None]
        if history:
            ax.plot([p["version"] for p in history], [p["value"] for p in history], marker="o", linestyle="--",
                    label=f"held-out success ({env})")
    ax.set_ylabel("last episodes window")
    ax.set_ylim(-1.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    losses = [(s, p.loss) for s, p in zip(steps, points) if p.loss is not None]
    ax_loss.plot([s for s, _ in losses], [v for _, v in losses], color="tab:gray")
    ax_loss.set_ylabel("policy loss")
    ax_loss.set_xlabel("training step (policy version)")
    ax_loss.grid(alpha=0.3)
    fig.suptitle(f"earl_stream learning curve: {steps[-1]} steps in {points[-1].wall_seconds:.0f}s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
