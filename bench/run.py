"""Run the benchmarks whose results the README and the docs cite (`bench/catalog.py`'s `RELEASE`), one at a
time, then regenerate docs/BENCHMARKS.md and the README's results table (`bench/report.py`).

    python bench/run.py --list              # each command and its stated time, and the total
    python bench/run.py                     # every cited result, in the catalog's order
    python bench/run.py --stale             # only the results whose measured code changed since they were measured
                                            # (a campaign that spans days resumes where it stopped)
    python bench/run.py --only dispatch engine
    python bench/run.py --quick             # each benchmark's --quick settings, written under build/bench-quick/:
                                            # checks that every command runs, leaves bench/results/ untouched

Run it on a quiet machine: the results are times, and another job on the same cores is in them. A command
that fails stops the run (its output is above); the results written before it stay.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.catalog import BENCHMARKS, RELEASE  # noqa: E402

QUICK_DIR = ROOT / "build" / "bench-quick"


def argv_of(run: dict[str, Any], quick: bool, out_dir: Path) -> list[str]:
    """The command of one release run as this interpreter runs it: `python` is this one, a leading `sudo` is
    dropped where this process is root, and with `quick` the run's `quick_args` (default `--quick`) are added and
    its results go under `out_dir`."""
    words = shlex.split(run.get("quick_command", run["command"]) if quick else run["command"])
    if words[0] == "sudo":
        words = words[1:] if os.geteuid() == 0 else ["sudo", "-E", *words[1:]]
    at = words.index("python")
    words[at] = sys.executable
    if quick:
        words = [w.replace("bench/results/", f"{out_dir}/") if w.startswith("bench/results/") else w for w in words]
        words += run.get("quick_args", ["--quick"])
    return [os.path.expanduser(w) for w in words]


def output_of(run: dict[str, Any]) -> Path:
    """The results file a release run writes (its `--json`/`--out` argument)."""
    words = shlex.split(run["command"])
    for flag in ("--json", "--out"):
        if flag in words:
            return ROOT / words[words.index(flag) + 1]
    raise ValueError(f"{run['command']!r} names no --json or --out file")


def is_stale(run: dict[str, Any]) -> bool:
    """Whether the result this run writes is missing, uncommitted or stale (of a run of one `part`, that part's)."""
    from bench.report import measurements

    path = output_of(run)
    if not path.exists():
        return True
    bench = next(b for b in BENCHMARKS if b["name"] == run["name"])
    found = measurements(json.loads(path.read_text()), path, bench["depends_on"], bench.get("not_measured", []))
    part = run.get("part", "")
    mine = [m for m in found if m[0] == part] or found[:1]
    return any(not commit or changed for _, commit, _, _, changed in mine)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the commands and their stated minutes, run nothing")
    ap.add_argument("--stale", action="store_true", help="run only the results that are missing or stale")
    ap.add_argument("--only", nargs="+", default=[], metavar="NAME", help="benchmarks to run (catalog names)")
    ap.add_argument("--quick", action="store_true", help=f"short settings, written under {QUICK_DIR.relative_to(ROOT)}/")
    args = ap.parse_args(argv)
    names = {r["name"] for r in RELEASE}
    unknown = sorted(set(args.only) - names)
    if unknown:
        ap.error(f"--only: no cited benchmark named {', '.join(unknown)}; choose from {', '.join(sorted(names))}")
    runs = [r for r in RELEASE if not args.only or r["name"] in args.only]
    if args.stale:
        runs = [r for r in runs if is_stale(r)]
    stated = "quick_minutes" if args.quick else "minutes"
    minutes = sum(r[stated] for r in runs)
    print(f"{len(runs)} benchmark runs, stated time {minutes:.0f} min ({minutes / 60:.1f} h) on 2 CPU cores"
          f"{' (--quick)' if args.quick else ''}:")
    for r in runs:
        print(f"  {r[stated]:>5.0f} min  {r['command']}")
    if args.list:
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for r in runs:
        words = argv_of(r, args.quick, QUICK_DIR)
        print(f"\n== {r['name']}: {shlex.join(words)}", flush=True)
        start = time.monotonic()
        done = subprocess.run(words, cwd=ROOT, env=env)
        took = (time.monotonic() - start) / 60
        if done.returncode != 0:
            print(f"bench/run.py: {r['name']} failed (exit {done.returncode}) after {took:.1f} min", file=sys.stderr)
            return done.returncode
        print(f"== {r['name']}: {took:.1f} min (stated {r[stated]:.0f})")
    if not args.quick:
        return subprocess.run([sys.executable, str(ROOT / "bench" / "report.py")], cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
