"""Render docs/BENCHMARKS.md from the benchmark results in bench/results/*.json.

    python bench/report.py [--results bench/results] [--out docs/BENCHMARKS.md]

Every benchmark of the project gets a section: what it measures (the opening paragraph of its
script's docstring, so the page cannot drift from the code), the command that regenerates it, the
latest numbers (a table per benchmark; benchmarks without a dedicated renderer get their scalar
results as a table), its plots (PNGs next to the JSON) and the machine it ran on. A benchmark whose
results file is missing shows "not run yet", or the commit that holds its last result. `make bench` measures the
cited results (bench/run.py) and then runs this script.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT))
from bench.catalog import BENCHMARKS, RELEASE, REMOVED  # noqa: E402
from bench.figures import Figure, all_figures, cpus_of, short_cpu  # noqa: E402
from bench.provenance import changed_since, git  # noqa: E402
from bench.report_tables import fmt  # noqa: E402

Renderer = Callable[[dict[str, Any]], list[str]]
README_BEGIN, README_END = "<!-- results:begin (bench/report.py) -->", "<!-- results:end -->"
FIGURES_BEGIN, FIGURES_END = "<!-- figures:begin (bench/report.py) -->", "<!-- figures:end -->"
RESULTS_PAGE = ROOT / "docs" / "results.md"


# ------------------------------------------------------------------------------------- the page

def what_it_measures(script: Path) -> str:
    """The opening paragraph of the script's module docstring (the script may not exist yet)."""
    if not script.exists():
        return "(script not written yet)"
    if script.suffix != ".py":  # a shell script: its opening comment block
        comments = [ln.lstrip("# ").rstrip() for ln in script.read_text().splitlines()[1:] if ln.startswith("#")]
        lines = script.read_text().splitlines()[1:]
        block = [ln.lstrip("#").strip() for ln in lines[:next((i for i, ln in enumerate(lines) if not ln.startswith("#")),
                                                               len(lines))]]
        return " ".join(block).strip() or " ".join(comments[:3])
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


MACHINE_KEYS = ("cpus", "cores", "threads", "torch_threads", "load_avg_before", "load_avg_after", "load_average_at_end",
                "loadavg_1m_before", "loadavg_1m_after", "platform", "cpu", "torch", "gpu", "driver", "cuda")


def measured_at(data: dict[str, Any], path: Path, prov: dict[str, Any] | None = None) -> tuple[str, str]:
    """(commit, date) a result (or one part of it: `prov`, an entry of its `part_provenance`) was measured at: its
    own provenance when it names a clean checkout, else the commit that first committed the file after its
    measurement (a later commit that only scrubs a path in it does not make it current), else the one that last
    wrote it; ("", "") while the file is not committed. A provenance commit this history lacks (work re-committed
    after a rewrite) counts as a dirty checkout."""
    prov = (data.get("provenance") or {}) if prov is None else prov
    if prov.get("commit") and not prov.get("dirty") and git("cat-file", "-e", f"{prov['commit']}^{{commit}}")[0] == 0:
        return prov["commit"], str(prov.get("when", ""))[:10]
    rel = str(path.resolve().relative_to(ROOT))
    if prov.get("when"):
        rc, out = git("log", "--reverse", f"--since={prov['when']}", "--format=%H %cs", "--", rel)
        if rc == 0 and out:
            commit, date = out.splitlines()[0].split()
            return commit, date
    rc, out = git("log", "-1", "--format=%H %cs", "--", rel)
    if rc != 0 or not out:
        return "", ""
    commit, date = out.split()
    return commit, date


def measurements(data: dict[str, Any], path: Path, depends_on: list[str], not_measured: list[str] = ()  # type: ignore[assignment]
                 ) -> list[tuple[str, str, str, list[str], list[str]]]:
    """(part, commit, date, measured paths, paths changed since) of the result and of each part it kept from an
    earlier run (`part_provenance`: a benchmark run one part at a time): a merged file is only as current as its
    oldest part. The whole result's part is ""."""
    out = []
    for part, prov in [("", data.get("provenance") or {}), *sorted((data.get("part_provenance") or {}).items())]:
        commit, date = measured_at(data, path, prov)
        deps = list(prov.get("depends_on") or depends_on)
        out.append((part, commit, date, deps, changed_since(commit, deps, not_measured)))
    return out


def currency(data: dict[str, Any], path: Path, depends_on: list[str], not_measured: list[str] = ()  # type: ignore[assignment]
             ) -> tuple[str, bool]:
    """One line on when and at which commit a result (and each part it kept from an earlier run) was measured and
    whether the code it measures has changed since (the stale mark), and whether it is stale."""
    found = measurements(data, path, depends_on, not_measured)
    if not found[0][1]:
        return "Measured: not committed yet.", False
    deps = found[0][3]
    cpus = cpus_of(data)
    on = {part: f" on {short_cpu(cpu)}" for part, cpu in cpus.items()} if len(set(cpus.values())) > 1 else {}
    where = "; ".join(f"{f'part `{part}` ' if part else ''}{'m' if part else 'M'}easured {date} at `{commit[:7]}`"
                      f"{on.get(part, '')}" for part, commit, date, _, _ in found)
    changed = sorted({c for *_, ch in found for c in ch})
    if not changed:
        return f"{where}; the code it measures ({', '.join(f'`{d}`' for d in deps)}) is unchanged since.", False
    shown = ", ".join(f"`{c}`" for c in changed[:6]) + (f" and {len(changed) - 6} more files" if len(changed) > 6 else "")
    return f"{where}. **Stale**: changed since: {shown}.", True


def machine_of(d: dict[str, Any]) -> str:
    """What the results file says about its machine."""
    found: dict[str, Any] = {}

    def walk(node: Any, depth: int) -> None:
        if not isinstance(node, dict) or depth > 2:
            return
        for k, v in node.items():
            if k in MACHINE_KEYS and not isinstance(v, dict):
                found.setdefault(k, v)
            walk(v, depth + 1)

    walk((d.get("provenance") or {}).get("machine", {}), 0)
    if len(cpus := set(cpus_of(d).values())) > 1:  # parts measured on different machines: the line above names each
        found["cpu"] = " and ".join(sorted(short_cpu(c) for c in cpus)) + " (by part: above)"
    walk(d.get("machine", d), 0)
    if isinstance(d.get("host"), dict):
        walk(d["host"], 0)
    if isinstance(d.get("machine"), dict) and d["machine"].get("note"):
        found["note"] = d["machine"]["note"]
    walk(d.get("config", {}), 1)
    parts = [f"{k.replace('_', ' ')} {fmt(v, 2)}" for k, v in found.items()]
    return "; ".join(parts) if parts else "not recorded"


def result_files(bench: dict[str, Any], results: Path) -> list[Path]:
    files: list[Path] = []
    for pattern in bench["files"]:
        files += [p for p in sorted(results.glob(pattern)) if p not in files and not p.name.endswith(".summary.json")]
    return files


def section(bench: dict[str, Any], results: Path, out_dir: Path) -> tuple[list[str], set[str]]:
    """The page's section of one benchmark and the plot files it shows."""
    release = [r["command"] for r in RELEASE if r["name"] == bench["name"]]
    regenerate = (f"`make bench BENCH_ARGS=\"--only {bench['name']}\"`, i.e. " + "; ".join(f"`{c}`" for c in release)
                  if release else f"`{bench['command']}`")
    out = [f"## {bench['title']}", "", what_it_measures(ROOT / bench["script"]), "", f"Regenerate: {regenerate}", ""]
    files, plots = result_files(bench, results), set()
    gone = [f"`git show {REMOVED[n]}:bench/results/{n}`" for n in sorted(REMOVED)
            if any(fnmatch.fnmatch(n, pattern) for pattern in bench["files"])]
    if gone:
        out += [f"Not in this release's results (no page cites it; [History](history.md#results-removed-at-030)): "
                f"{', '.join(gone)}.", ""]
    if not files:
        return out + ([] if gone else [f"**Not run yet** (no `bench/results/{bench['files'][0]}`).", ""]), plots
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            out += [f"`{path.name}`: unreadable ({exc}).", ""]
            continue
        if len(files) > 1:
            out += [f"### `{path.name}`", ""]
        out += [currency(data, path, bench["depends_on"], bench.get("not_measured", []))[0], "",
                f"Machine: {machine_of(data)}.", ""]
        out += bench["render"](data)
        png = path.with_suffix(".png")
        copy = out_dir / "benchmarks" / png.name
        if png.exists():  # copied next to the page, so that the docs site can show it
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, copy)
        if copy.exists():  # a fresh clone has only the copy
            plots.add(copy.name)
            out += [f"![{bench['name']}]({os.path.relpath(copy, out_dir)})", ""]
    return out, plots


def _slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def render(results: Path, out: Path) -> str:
    """The page; also removes plot copies under docs/benchmarks/ that no result shows any more."""
    lines = ["# Benchmarks", "",
             "Generated by `bench/report.py` from `bench/results/*.json` (`make bench-report`); "
             "`make bench` measures the results the README and the docs cite, then runs this generator; every "
             "other benchmark below runs by the command its section names. Do not edit by hand: "
             "`tests/test_benchmarks_page.py` regenerates this page and compares it byte for byte.", "",
             "Each result says when and at which commit it was measured, and is marked **Stale** when the code "
             "it measures had changed since, as of the page's last regeneration (`make bench-report`). "
             "The machines are shared with other jobs: treat single numbers "
             "as +-35%.", ""]
    lines += [f"- [{b['title']}](#{_slug(b['title'])})" for b in BENCHMARKS] + [""]
    shown: set[str] = set()
    for bench in BENCHMARKS:
        body, plots = section(bench, results, out.parent)
        lines += body
        shown |= plots
    for old in sorted((out.parent / "benchmarks").glob("*.png")):
        if old.name not in shown:
            old.unlink()
    return "\n".join(lines).rstrip() + "\n"


_MARKS = (
    (re.compile(r"; the code it measures \(.*?\) is unchanged since\.$", re.M), " <currency>."),
    (re.compile(r"\. \*\*Stale\*\*: changed since: .*\.$", re.M), " <currency>."),
    (re.compile(r"\| (?:yes|stale: \d+ files? changed) \|$", re.M), "| <currency> |"),
)


def without_marks(text: str) -> str:
    """The text with its stale marks masked: every commit that touches measured code moves them, so the
    tests compare generated pages on everything else (results, figures, dates, commits) and `make
    bench-report` refreshes the marks."""
    for pattern, mask in _MARKS:
        text = pattern.sub(mask, text)
    return text


def readme_table(results: Path) -> str:
    """The README's currency table: each result file the README cites, when and at which commit it was
    measured, and whether the code it measures changed since (the stale mark)."""
    cited = sorted(set(re.findall(r"bench/results/([\w.-]+\.json)", README.read_text())))
    rows = ["| result | measured | current? |", "|---|---|---|"]
    for name in cited:
        path = results / name
        if not path.exists():
            continue
        found = file_measurements(results, name)
        _, commit, date = oldest(found)[:3]
        changed = {c for *_, ch in found for c in ch}
        bench = bench_of(name)
        mark = (f"stale: {len(changed)} file{'s' if len(changed) > 1 else ''} changed" if changed else "yes") if commit else "uncommitted"
        anchor = _slug(bench["title"]) if bench else ""
        rows.append(f"| [`{name}`](docs/BENCHMARKS.md#{anchor}) | {date} `{commit[:7]}` | {mark} |")
    return "\n".join(rows) + "\n"


def _loader(results: Path) -> Callable[[str], dict[str, Any] | None]:
    def load(name: str) -> dict[str, Any] | None:
        path = results / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None
    return load


def bench_of(name: str) -> dict[str, Any] | None:
    """The catalog's benchmark that writes the results file `name`."""
    return next((b for b in BENCHMARKS if any(fnmatch.fnmatch(name, f) for f in b["files"])), None)


@functools.cache  # a page cites one file in several figures: its git lookups once per report
def file_measurements(results: Path, name: str) -> list[tuple[str, str, str, list[str], list[str]]]:
    """`measurements` of the results file `name` under `results`, with its catalog entry's measured paths."""
    path, bench = results / name, bench_of(name)
    return measurements(json.loads(path.read_text()), path, bench["depends_on"] if bench else [],
                        bench.get("not_measured", []) if bench else [])


def oldest(found: list[tuple[str, str, str, list[str], list[str]]]) -> tuple[str, str, str, list[str], list[str]]:
    """The part measured first (a part not committed yet counts as the newest)."""
    return min(found, key=lambda m: m[2] or "9")


REFERENCE_CPU = "AMD EPYC"  # the CPU the pages name once; a result measured on another says which


def stamp(results: Path, name: str, part: str = "") -> str:
    """`DATE COMMIT` a result file was measured at (its oldest part's, or the named `part`'s: a part it kept from an
    earlier run, else the last run's), and its CPUs where they are not `REFERENCE_CPU` alone (the machines lent to a
    session differ; a file's parts may have run on different ones)."""
    data, found = json.loads((results / name).read_text()), file_measurements(results, name)
    by_part = cpus_of(data)
    if part:
        key = part if part in (data.get("part_provenance") or {}) else ""
        found, by_part = [m for m in found if m[0] == key], {key: by_part[key]} if key in by_part else {}
    _, commit, date = oldest(found)[:3]
    if not commit:
        return "not committed"
    cpus = sorted(set(by_part.values()))
    other = ", " + " and ".join(short_cpu(c) for c in cpus) if cpus and cpus != [REFERENCE_CPU] else ""
    return f"{date} {commit[:7]}{other}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def figures_table(results: Path, figures: list[Figure] | None = None) -> str:
    """The README's results table: each figure's worst and best case, its files (date, commit) and conditions."""
    figures = all_figures(_loader(results)) if figures is None else figures
    rows = ["| figure | worst | best | result (date commit), conditions |", "|---|---|---|---|"]
    for f in figures:
        files = ", ".join(f"`bench/results/{n}` ({stamp(results, n, f.part)})" for n in f.files)
        rows.append(f"| {_cell(f.figure)} | {_cell(f.worst)} | {_cell(f.best)} | {files}: {_cell(f.short)} |")
    return "\n".join(rows) + "\n"


def results_page(results: Path) -> str:
    """docs/results.md: every figure the README quotes with its full conditions."""
    lines = ["# Results in detail", "",
             "Generated by `bench/report.py` from `bench/results/*.json` (`bench/figures.py` computes each figure; do "
             "not edit by hand). Every figure the README's results table quotes, with the benchmark, its repeats and "
             "intervals (95%, as `[low, high]`) and its conditions. The worst column holds the worst value of the "
             "quantity in the whole result file. The raw numbers and curves are in [Benchmarks](BENCHMARKS.md); "
             "results no page cites any more are in [History](history.md).", "",
             f"2 cores ({REFERENCE_CPU}, unless a row names another CPU) shared with other jobs, 24 GiB, no GPU, "
             "unless a row names one; a result is stale "
             "once the code it measures changed after the commit that measured it.", "",
             "| figure | worst | best | benchmark and conditions |", "|---|---|---|---|"]
    for f in all_figures(_loader(results)):
        files = ", ".join(f"`bench/results/{n}` ({stamp(results, n, f.part)})" for n in f.files)
        lines.append(f"| {_cell(f.figure)} | {_cell(f.worst)} | {_cell(f.best)} | {_cell(f.details)}. {files} |")
    return "\n".join(lines) + "\n"


def _replace_block(readme: Path, begin: str, end: str, table: str) -> bool:
    """Replace the block between two markers in the README; False when it has no markers."""
    text = readme.read_text()
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{begin}\n{table}{end}{tail}")
    return True


def update_readme(readme: Path, table: str) -> bool:
    """Replace the block between the results markers in the README; False when it has no markers."""
    return _replace_block(readme, README_BEGIN, README_END, table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"), help="directory of the results JSON files")
    ap.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="the page to write")
    ap.add_argument("--readme", default=str(ROOT / "README.md"),
                    help=f"a README whose block between {README_BEGIN!r} and {README_END!r} gets the results table")
    args = ap.parse_args()
    out, results = Path(args.out), Path(args.results).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, out.resolve()))
    print(f"wrote {out}")
    if _replace_block(Path(args.readme), FIGURES_BEGIN, FIGURES_END, figures_table(results)):
        print(f"updated the figures table in {args.readme}")
    if update_readme(Path(args.readme), readme_table(results)):  # of the files the figures cite
        print(f"updated the results table in {args.readme}")
    if Path(args.out).resolve() == (ROOT / "docs" / "BENCHMARKS.md").resolve():
        RESULTS_PAGE.write_text(results_page(results))
        print(f"wrote {RESULTS_PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
