"""Render docs/BENCHMARKS.md from the benchmark results in bench/results/*.json.

    python bench/report.py [--results bench/results] [--out docs/BENCHMARKS.md]

Every benchmark of the project gets a section: what it measures (the opening paragraph of its
script's docstring, so the page cannot drift from the code), the command that regenerates it, the
latest numbers (a table per benchmark; benchmarks without a dedicated renderer get their scalar
results as a table), its plots (PNGs next to the JSON) and the machine it ran on. A benchmark whose
results file is missing shows "not run yet". `make bench` runs every benchmark and then this script.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
Renderer = Callable[[dict[str, Any]], list[str]]


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:,.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
        return ", ".join(_fmt(x, digits) for x in v)
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return out + [""]


def _scalars(d: dict[str, Any], prefix: str = "", depth: int = 2) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) and depth > 1:
            rows += _scalars(v, f"{prefix}{k}.", depth - 1)
        elif isinstance(v, (int, float, str, bool)) or v is None or (
                isinstance(v, list) and len(v) <= 4 and all(isinstance(x, (int, float)) for x in v)):
            if isinstance(v, str) and len(v) > 120:
                continue
            rows.append([f"`{prefix}{k}`", v])
    return rows


# ------------------------------------------------------------------------------------ renderers

def render_generic(d: dict[str, Any]) -> list[str]:
    rows = _scalars(d)
    return _table(["result", "value"], rows[:60]) if rows else ["(no scalar results)", ""]


def render_dispatch(d: dict[str, Any]) -> list[str]:
    rows = []
    for name, r in d.get("layouts", {}).items():
        rows.append([name, r.get("bytes_delivered", 0) / 2**20, r.get("pull_seconds"), r.get("pull_zero_copy_seconds"),
                     r.get("pull_tcp_seconds"), r.get("central_seconds"), r.get("ray_seconds"),
                     r.get("speedup_vs_central"), r.get("speedup_vs_ray")])
    out = _table(["layout", "MiB/step", "pull s", "pull zero-copy s", "pull TCP s", "central s", "Ray s",
                  "x vs central", "x vs Ray"], rows)
    c = d.get("ceilings", {})
    out.append(f"Same-host ceilings: memcpy {_fmt(c.get('memcpy_gibps'))} GiB/s, shared memory (copy in + copy "
               f"out) {_fmt(c.get('shm_gibps'))} GiB/s. Medians over {_fmt(d.get('config', {}).get('repetitions'))} "
               "repetitions.")
    return out + [""]


def render_memory_model(d: dict[str, Any]) -> list[str]:
    out: list[str] = []
    llama = d.get("llama70b", {})
    k = llama.get("korthikanti", {})
    if k:
        rows = [[name, *v.get("all_80_layers_gib", []), v.get("ratio_8192_over_4096")] for name, v in k.items()]
        out.append(f"(a) {llama.get('model', 'Llama-3.1-70B')}, activations of all layers (GiB) at "
                   f"{_fmt(llama.get('seq_lens'))} tokens; the paper reports {_fmt(llama.get('paper_gb'))} GB:")
        out.append("")
        out += _table(["attention", "GiB @4096", "GiB @8192", "ratio"], rows)
    m = d.get("measured", {})
    rows = [[c["model"], c["attn"], c["loss"], c["seq_len"], c["micro_batch"], c["ckpt"], c["predicted_bytes"] / 2**20,
             c["measured_bytes"] / 2**20, f"{100 * c['relative_error']:+.1f}%"] for c in m.get("configs", [])]
    if rows:
        out.append("(b) predicted vs measured peak training memory on this machine (MiB):")
        out.append("")
        out += _table(["model", "attention", "loss", "seq", "micro-batch", "recompute", "predicted", "measured",
                       "error"], rows)
    out.append(f"Largest relative error: **{_fmt(100 * (d.get('max_relative_error') or 0), 2)}%**.")
    return out + [""]


def render_learning(d: dict[str, Any]) -> list[str]:
    keys = ("budget_minutes", "target_win_rate", "start_win_rate", "max_win_rate", "final_win_rate",
            "mean_win_rate_second_half", "min_win_rate_second_half", "time_to_target_s", "steps")
    rows = [[k, d.get(k)] for k in keys if k in d]
    if "overrides" in d:
        rows.append(["overrides", " ".join(d["overrides"]) or "none (the embedded default)"])
    return _table(["result", "value"], rows)


def render_e2e(d: dict[str, Any]) -> list[str]:
    out = [f"Same model, game (Tic-Tac-Toe vs random), group size {d.get('group_size')}, "
           f"{d.get('samples_per_step')} samples per step, lr {d.get('lr')}; {_fmt(d.get('seconds_per_system'))} s "
           f"measured per system after its first step; win rate over the last {d.get('stats_window_games')} games.",
           ""]
    rows = []
    for name, r in d.get("systems", {}).items():
        if "error" in r:
            rows.append([name, "failed", None, None, None, None, None, None])
            continue
        cores = ", ".join(f"{k}: {v}" for k, v in d.get("core_assignment", {}).get(name, {}).items())
        rows.append([r.get("system", name), r.get("samples_per_s"), r.get("generated_tokens_per_s"),
                     r.get("trained_tokens_per_s"), r.get("steps_per_s"), r.get("cpu_seconds_per_sample"),
                     r.get("start_win_rate"), r.get("final_win_rate"), r.get("time_to_target_s"), cores])
    out += _table(["system", "samples/s", "generated tok/s", "trained tok/s", "steps/s", "CPU-s/sample",
                   "first win rate", "last win rate", f"s to win rate {d.get('target_win_rate')} (from launch)",
                   "cores"], rows)
    tg = d.get("targets", {})
    out.append(f"**async / sync = {_fmt(d.get('async_vs_sync'))}** (target {tg.get('async_vs_sync')}), "
               f"**async / TRL = {_fmt(d.get('async_vs_trl'))}** (target {tg.get('async_vs_trl')}); "
               f"targets missed: {', '.join(d.get('targets_missed') or []) or 'none'}.")
    out.append("")
    if d.get("async_vs_sync_ceiling"):
        out += [f"Ceiling of async / sync for this core split: {_fmt(d['async_vs_sync_ceiling'])} "
                f"({d.get('ceiling_note')}).", ""]
    out += [f"- {f}" for f in d.get("findings", [])] + ([""] if d.get("findings") else [])
    sd = d.get("sample_definition", {})
    out += [f"A sample: earl_stream — {sd.get('earl_stream')}; TRL — {sd.get('trl')}.", ""]
    prof = {k: v.get("profile") for k, v in d.get("systems", {}).items() if v.get("profile")}
    if prof:
        out += ["Where the time goes (fractions of the measured window; CPU = cores used by that process):", ""]
        flat = {name: {**{f"CPU {k}": v for k, v in p.get("cpu_utilisation", {}).items()},
                       **{k.replace("_", " "): v for k, v in p.items() if isinstance(v, (int, float))}}
                for name, p in prof.items()}
        measures = list(dict.fromkeys(m for f in flat.values() for m in f))
        out += _table(["measure", *flat], [[m, *(f.get(m) for f in flat.values())] for m in measures])
        out += [f"- {name}: {p['note']}" for name, p in prof.items() if p.get("note")] + [""]
    return out


BENCHMARKS: list[dict[str, Any]] = [
    {"name": "dispatch", "title": "Dispatch: layout-aware pull vs central vs Ray", "script": "bench/dispatch.py",
     "command": "python bench/dispatch.py --json bench/results/dispatch.json", "files": ["dispatch.json", "dispatch_*.json"],
     "render": render_dispatch},
    {"name": "memory_model", "title": "Memory model: predicted vs measured peak memory",
     "script": "bench/memory_model.py", "command": "python bench/memory_model.py --json bench/results/memory_model.json",
     "files": ["memory_model.json"], "render": render_memory_model},
    {"name": "selector", "title": "Parallelism selector: static plans vs the adaptive selector",
     "script": "bench/selector.py", "command": "python bench/selector.py --json bench/results/selector.json",
     "files": ["selector.json"], "render": render_generic},
    {"name": "engine", "title": "Engine: built-in engine vs `model.generate` on multi-turn episodes",
     "script": "bench/engine.py", "command": "python bench/engine.py --json bench/results/engine.json",
     "files": ["engine.json"], "render": render_generic},
    {"name": "learning", "title": "Learning: win rate against the random opponent over time",
     "script": "bench/learning.py", "command": "python bench/learning.py --minutes 20 --json bench/results/learning.json",
     "files": ["learning.json", "learning_*.json"], "render": render_learning},
    {"name": "e2e", "title": "End-to-end: asynchronous vs synchronous vs TRL", "script": "bench/e2e.py",
     "command": "python bench/e2e.py --json bench/results/e2e.json", "files": ["e2e.json"], "render": render_e2e},
]


# ------------------------------------------------------------------------------------- the page

def what_it_measures(script: Path) -> str:
    """The opening paragraph of the script's module docstring (the script may not exist yet)."""
    if not script.exists():
        return "(script not written yet)"
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


MACHINE_KEYS = ("cpus", "cores", "threads", "torch_threads", "load_avg_before", "load_avg_after", "load_average_at_end",
                "loadavg_1m_before", "loadavg_1m_after", "platform", "cpu", "torch")


def _written(path: Path) -> dt.datetime:
    """When a results file was written: its commit time while it is unchanged since (a checkout sets every
    file's mtime to the checkout time), else its mtime."""
    git = ["git", "-C", str(path.parent)]
    unchanged = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", path.name], capture_output=True)
    if unchanged.returncode == 0:
        out = subprocess.run([*git, "log", "-1", "--format=%cI", "--", path.name], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return dt.datetime.fromisoformat(out.stdout.strip()).astimezone(dt.timezone.utc)
    return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc)


def machine_of(d: dict[str, Any], path: Path) -> str:
    """What the results file says about its machine, plus when it was written."""
    found: dict[str, Any] = {}

    def walk(node: Any, depth: int) -> None:
        if not isinstance(node, dict) or depth > 2:
            return
        for k, v in node.items():
            if k in MACHINE_KEYS and not isinstance(v, dict):
                found.setdefault(k, v)
            walk(v, depth + 1)

    walk(d.get("machine", d), 0)
    if isinstance(d.get("host"), dict):
        walk(d["host"], 0)
    if isinstance(d.get("machine"), dict) and d["machine"].get("note"):
        found["note"] = d["machine"]["note"]
    walk(d.get("config", {}), 1)
    when = _written(path).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"{k.replace('_', ' ')} {_fmt(v, 2)}" for k, v in found.items()]
    return f"written {when}" + ("; " + "; ".join(parts) if parts else "")


def this_machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1])
        mem_s = f"{mem / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        mem_s = "unknown RAM"
    return f"{os.cpu_count()} CPUs ({cpu}), {mem_s}, no GPU, {platform.system()} {platform.release()}, " \
           f"Python {platform.python_version()}"


def section(bench: dict[str, Any], results: Path, out_dir: Path) -> list[str]:
    out = [f"## {bench['title']}", "", what_it_measures(ROOT / bench["script"]), "",
           f"Regenerate: `{bench['command']}`", ""]
    files: list[Path] = []
    for pattern in bench["files"]:
        files += [p for p in sorted(results.glob(pattern)) if p not in files and not p.name.endswith(".summary.json")]
    if not files:
        return out + [f"**Not run yet** (no `{results.relative_to(ROOT) if results.is_relative_to(ROOT) else results}/"
                      f"{bench['files'][0]}`).", ""]
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            out += [f"`{path.name}`: unreadable ({exc}).", ""]
            continue
        if len(files) > 1:
            out += [f"### `{path.name}`", ""]
        out += [f"Machine: {machine_of(data, path)}.", ""]
        out += bench["render"](data)
        png = path.with_suffix(".png")
        if png.exists():  # copied next to the page: bench/results/*.png is not versioned
            copy = out_dir / "benchmarks" / png.name
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, copy)
            out += [f"![{bench['name']}]({os.path.relpath(copy, out_dir)})", ""]
    return out


def _slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def render(results: Path, out: Path) -> str:
    lines = ["# Benchmarks", "",
             "Generated by `bench/report.py` from `bench/results/*.json`; regenerate everything with `make bench` "
             "(it runs every benchmark below, then this generator). Do not edit by hand.", "",
             f"Report generated on: {this_machine()}. These machines are shared with other jobs: treat single "
             "numbers as +-35%.", ""]
    lines += [f"- [{b['title']}](#{_slug(b['title'])})" for b in BENCHMARKS] + [""]
    for bench in BENCHMARKS:
        lines += section(bench, results, out.parent)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"), help="directory of the results JSON files")
    ap.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="the page to write")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(Path(args.results).resolve(), out.resolve()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
