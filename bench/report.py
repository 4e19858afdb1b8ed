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
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.report_tables import (  # noqa: E402
    fmt,
    render_algorithms,
    render_context_growth,
    render_dispatch,
    render_dispatch_cluster,
    render_e2e,
    render_generic,
    render_learning,
    render_memory_model,
    render_openai_endpoint,
    render_policy_audit,
    render_selector,
    render_weight_sync,
)

Renderer = Callable[[dict[str, Any]], list[str]]


BENCHMARKS: list[dict[str, Any]] = [
    {"name": "dispatch", "title": "Dispatch: layout-aware pull vs central vs Ray", "script": "bench/dispatch.py",
     "command": "python bench/dispatch.py --json bench/results/dispatch.json", "files": ["dispatch.json", "dispatch_ucx.json"],
     "render": render_dispatch},
    {"name": "dispatch_cluster", "title": "Dispatch at cluster shape: rate-limited hosts, experience and weights",
     "script": "bench/dispatch_cluster.py",
     "command": "sudo python bench/dispatch_cluster.py --json bench/results/dispatch_cluster.json",
     "files": ["dispatch_cluster.json", "dispatch_cluster_*.json"], "render": render_dispatch_cluster},
    {"name": "memory_model", "title": "Memory model: predicted vs measured peak memory",
     "script": "bench/memory_model.py", "command": "python bench/memory_model.py --json bench/results/memory_model.json",
     "files": ["memory_model.json"], "render": render_memory_model},
    {"name": "weight_sync", "title": "Weight sync: sharded publish + pull vs the rank-0 full copy",
     "script": "bench/weight_sync.py", "command": "python bench/weight_sync.py --json bench/results/weight_sync.json",
     "files": ["weight_sync.json"], "render": render_weight_sync},
    {"name": "selector", "title": "Parallelism selector: static plans vs the adaptive selector",
     "script": "bench/selector.py", "command": "python bench/selector.py --json bench/results/selector.json",
     "files": ["selector.json"], "render": render_selector},
    {"name": "engine", "title": "Engine: built-in engine vs `model.generate` on multi-turn episodes",
     "script": "bench/engine.py", "command": "python bench/engine.py --json bench/results/engine.json",
     "files": ["engine.json"], "render": render_generic},
    {"name": "learning", "title": "Learning: win rate against the random opponent over time",
     "script": "bench/learning.py", "command": "python bench/learning.py --minutes 15 --json bench/results/learning.json",
     "files": ["learning.json", "learning_*.json"], "render": render_learning},
    {"name": "real_model", "title": "A real pretrained model: SmolLM2-135M-Instruct learns arithmetic",
     "script": "bench/real_model.py", "command": "python bench/real_model.py --minutes 60 --json bench/results/real_model.json",
     "files": ["real_model.json", "real_model_*.json"], "render": render_generic},
    {"name": "algorithms", "title": "Algorithms: estimators and loss options on the same budget and seeds",
     "script": "bench/algorithms.py", "command": "python bench/algorithms.py --minutes 5 --seeds 0 1",
     "files": ["algorithms.json"], "render": render_algorithms},
    {"name": "policy_audit", "title": "Exact audits of Tic-Tac-Toe policies: where the win rate stops",
     "script": "bench/policy_audit.py",
     "command": "python bench/policy_audit.py RUN_DIR/checkpoints/step_N ... --json bench/results/policy_audit.json",
     "files": ["policy_audit.json"], "render": render_policy_audit},
    {"name": "context_growth", "title": "Growing contexts: a static context limit vs the selector (EARL's Figure 1)",
     "script": "bench/context_growth.py",
     "command": "python bench/context_growth.py --unbounded --json bench/results/context_growth.json",
     "files": ["context_growth.json", "context_growth_*.json"],
     "render": render_context_growth},
    {"name": "openai_endpoint", "title": "OpenAI endpoint: agents through the API vs the built-in agent loop",
     "script": "bench/openai_endpoint.py",
     "command": "python bench/openai_endpoint.py --json bench/results/openai_endpoint.json",
     "files": ["openai_endpoint.json", "openai_endpoint_*.json"], "render": render_openai_endpoint},
    {"name": "data_mac", "title": "Authenticated data-plane frames: the cost of the MAC on TCP pulls",
     "script": "bench/data_mac.py", "command": "python bench/data_mac.py --json bench/results/data_mac.json",
     "files": ["data_mac.json"], "render": render_generic},
    {"name": "supervisor_load", "title": "The control plane under load: one supervisor, thousands of workers",
     "script": "bench/supervisor_load.py",
     "command": "python bench/supervisor_load.py --json bench/results/supervisor_load.json",
     "files": ["supervisor_load.json"], "render": render_generic},
    {"name": "fuzz", "title": "Fuzzing every port of a live run", "script": "bench/fuzz.py",
     "command": "python bench/fuzz.py --json bench/results/fuzz.json", "files": ["fuzz.json"], "render": render_generic},
    {"name": "chaos", "title": "Chaos: kill -9 of workers, trainer ranks and the supervisor during a run",
     "script": "bench/chaos.py", "command": "python bench/chaos.py --minutes 10 --json bench/results/chaos.json",
     "files": ["chaos.json"], "render": render_generic},
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
    when = f"{d['when']} (its own stamp)" if isinstance(d.get("when"), str) else _written(path).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"{k.replace('_', ' ')} {fmt(v, 2)}" for k, v in found.items()]
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
        copy = out_dir / "benchmarks" / png.name
        if png.exists():  # copied next to the page: bench/results/*.png is not versioned
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, copy)
        if copy.exists():  # a fresh clone has only the copy
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
