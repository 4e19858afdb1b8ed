"""docs/BENCHMARKS.md and the README's results table are generated (bench/report.py): regenerating them from
bench/results/ gives the committed text byte for byte, stale marks aside (every commit touching measured code
moves them; `make bench-report` refreshes them), so a result or a figure cannot drift."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _history_available() -> bool:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.strip() == "false"


pytestmark = pytest.mark.skipif(not _history_available(),
                                reason="the stale marks need the git history (not a shallow clone)")


def test_benchmarks_page_is_generated(tmp_path: Path) -> None:
    from bench.report import render, without_marks

    shutil.copytree(ROOT / "docs" / "benchmarks", tmp_path / "benchmarks")
    page = render(ROOT / "bench" / "results", tmp_path / "BENCHMARKS.md")
    committed = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert without_marks(page) == without_marks(committed), "docs/BENCHMARKS.md drifted from bench/results: run `make bench-report`"


def test_readme_results_table_is_generated() -> None:
    from bench.report import README_BEGIN, README_END, readme_table, without_marks

    readme = (ROOT / "README.md").read_text()
    assert README_BEGIN in readme and README_END in readme, "the README lost its generated results table"
    block = readme.split(README_BEGIN, 1)[1].split(README_END, 1)[0]
    assert without_marks(block) == without_marks("\n" + readme_table(ROOT / "bench" / "results")), \
        "the README's results table drifted from bench/results: run `make bench-report`"


def test_a_result_is_stale_once_its_code_changes(tmp_path: Path) -> None:
    """The stale mark compares the code a result measures at its commit with this checkout."""
    from bench.report import currency

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    first = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True,
                           check=True).stdout.split()[0]
    fresh = {"provenance": {"commit": head, "dirty": False, "when": "2026-01-01T00:00:00+00:00",
                            "depends_on": ["LICENSE"]}}
    assert currency(fresh, tmp_path / "x.json", [])[1] is False
    old = {"provenance": {"commit": first, "dirty": False, "when": "2026-01-01T00:00:00+00:00",
                          "depends_on": ["earl_stream/config"]}}
    line, stale = currency(old, tmp_path / "x.json", [])
    assert stale and "earl_stream/config/" in line


def test_provenance_names_the_commit_a_benchmark_started_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long benchmark measures the code it started from: a commit landing while it runs does not become
    its commit (it is named apart and the result is marked dirty: processes it started later ran newer code)."""
    import bench.provenance as prov

    head = {"rev-parse": "a" * 40, "diff": ""}
    monkeypatch.setattr(prov, "_git", lambda *args: head[args[0]])
    monkeypatch.setattr(prov, "_STARTED", prov._checkout())
    quiet = prov.provenance(["bench"])
    assert quiet["commit"] == "a" * 40 and not quiet["dirty"] and "commit_at_write" not in quiet
    head["rev-parse"] = "b" * 40  # a merge lands mid-run
    moved = prov.provenance(["bench"])
    assert moved["commit"] == "a" * 40 and moved["dirty"] and moved["commit_at_write"] == "b" * 40


def test_code_a_benchmark_never_runs_does_not_make_it_stale() -> None:
    """`not_measured` paths (the vLLM and SGLang engines for a run on the built-in engine) are left out of
    the stale check; the rest of the depends_on folder still counts."""
    from bench.catalog import BENCHMARKS
    from bench.provenance import changed_since

    real_scale = next(b for b in BENCHMARKS if b["name"] == "real_scale")
    assert "earl_stream/workers/engines/vllm_engine.py" in real_scale["not_measured"]
    engine = next(b for b in BENCHMARKS if b["name"] == "engine")
    assert "not_measured" not in engine  # bench/engine.py --vllm runs it
    first = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True,
                           text=True).stdout.split()[0]
    everything = changed_since(first, ["earl_stream/workers"])
    assert "earl_stream/workers/engines/vllm_engine.py" in everything
    rest = changed_since(first, ["earl_stream/workers"], real_scale["not_measured"])
    assert set(everything) - set(rest) == set(real_scale["not_measured"])


def test_a_change_to_docstrings_and_comments_only_leaves_a_result_current() -> None:
    """The stale check compares code: a module, class or function docstring and comments may change; a string
    that is not a docstring, a statement or a name may not."""
    from bench.provenance import same_code

    old = '"""Module."""\nimport os\n\n\nclass A:\n    """A."""\n\n    def f(self) -> str:\n        """F."""\n        return "x"\n'
    assert same_code(old, old.replace('"""A."""', '"""Another text,\n    on two lines."""').replace("import os", "import os  # why"))
    assert same_code(old, old.replace('    """A."""\n\n', ""))  # a docstring removed
    assert not same_code(old, old.replace('return "x"', 'return "y"'))
    assert not same_code(old, old.replace("import os", "import sys"))
    assert not same_code(old, old + "x = (\n")  # unparsable: never the same


def test_no_result_holds_a_machine_path() -> None:
    """bench/results/ holds no absolute path of the machine a benchmark ran on (`bench/provenance.py` scrubs them
    at the write; `python bench/provenance.py FILE` scrubs an older file)."""
    machine_path = re.compile(r'(?<![\w.$])/(?:work|home|tmp|root|Users|mnt|scratch)/')
    found = [f"{p.name}: {m.group(0)}..." for p in sorted((ROOT / "bench" / "results").glob("*.json"))
             for m in [machine_path.search(p.read_text())] if m]
    assert not found, "results with machine paths:\n" + "\n".join(found)


def test_the_comparison_masks_only_the_stale_marks() -> None:
    """A mark moving (a commit touched measured code) compares equal; a number changing does not."""
    from bench.report import without_marks

    fresh = "Measured 2026-11-26 at `b83f9ed`; the code it measures (`bench/x.py`) is unchanged since.\n| 1.5 |\n"
    stale = "Measured 2026-11-26 at `b83f9ed`. **Stale**: changed since: `bench/x.py`, `a.py` and 3 more files.\n| 1.5 |\n"
    assert without_marks(fresh) == without_marks(stale)
    assert without_marks(fresh) != without_marks(fresh.replace("1.5", "1.6"))
    assert without_marks(fresh) != without_marks(fresh.replace("b83f9ed", "c83f9ed"))
    row = "| [`a.json`](docs/BENCHMARKS.md#a) | 2026-11-26 `b83f9ed` | {} |"
    assert without_marks(row.format("yes")) == without_marks(row.format("stale: 64 files changed"))


def test_the_readme_figures_and_the_results_page_are_generated() -> None:
    """The README's figures and docs/results.md are computed from the results files (bench/figures.py): a
    re-measured result with other numbers fails here until `make bench-report` rewrites both."""
    from bench.report import FIGURES_BEGIN, FIGURES_END, figures_table, results_page

    readme = (ROOT / "README.md").read_text()
    block = readme.split(FIGURES_BEGIN, 1)[1].split(FIGURES_END, 1)[0]
    assert block == "\n" + figures_table(ROOT / "bench" / "results"), \
        "the README's figures drifted from bench/results: run `make bench-report`"
    assert (ROOT / "docs" / "results.md").read_text() == results_page(ROOT / "bench" / "results"), \
        "docs/results.md drifted from bench/results: run `make bench-report`"


def test_a_figure_quotes_the_worst_value_in_its_file() -> None:
    """The worst column is the worst value of the quantity in the whole file, not of a chosen subset: a row
    added to a result that is worse than the others becomes the README's worst."""
    from bench.figures import all_figures

    def load(name: str) -> dict | None:
        return json.loads(json.dumps(results[name])) if name in results else None

    results = {"openai_endpoint": {"models": {
        "default": {"tictactoe": {"endpoint_over_builtin_tokens_per_s": 0.48}},
        "random": {"tictactoe": {"endpoint_over_builtin_tokens_per_s": 0.27},
                   "calculator": {"endpoint_over_builtin_tokens_per_s": 0.84}}}},
               "weight_sync": {"full_over_sharded_total_seconds": {"1M_tp2": 7.3, "35M_fsdp2": 2.4, "1M_fsdp2": 4.0},
                               "repetitions": 5, "ranks": 2, "sizes": {"1M": {}, "35M": {}}, "dtype": "float32"}}
    figures = {f.figure: f for f in all_figures(load)}
    endpoint = figures["OpenAI endpoint vs built-in agent loop, tokens/s"]
    assert endpoint.worst.startswith("0.27 (a random tiny model, tictactoe)") and endpoint.best.startswith("0.84")
    sync = figures["sharded weight publish + pull vs rank-0 copy"]
    assert sync.worst == "2.4x (35M, fsdp2)" and sync.best == "7.3x (1M, tp2)"
    assert set(figures) == {endpoint.figure, sync.figure}  # a missing file: no figure


def test_make_bench_measures_every_cited_result_and_no_other() -> None:
    """`make bench` (bench/run.py, the catalog's RELEASE) writes every result file the README and the docs cite,
    at most ~15 of them plus the selector's calibration inputs, and every file in bench/results/ is one of them;
    a result removed from the release names the commit that still holds it."""
    from bench.catalog import BENCHMARKS, RELEASE, REMOVED
    from bench.run import output_of

    written = {output_of(r).name for r in RELEASE}
    names = {b["name"] for b in BENCHMARKS}
    assert all(r["name"] in names for r in RELEASE)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = {m for p in pages if p.name not in ("history.md", "BENCHMARKS.md")
             for m in re.findall(r"bench/results/([\w.-]+\.json)", p.read_text())}
    assert cited <= written, f"cited but not measured by `make bench`: {sorted(cited - written)}"
    assert len(written) <= 16, sorted(written)
    present = {p.name for p in (ROOT / "bench" / "results").glob("*.json")}
    assert present <= written, f"results no page cites (remove them, naming them in REMOVED): {sorted(present - written)}"
    assert not set(REMOVED) & present
    history = (ROOT / "docs" / "history.md").read_text()
    assert all(f"`{name}`" in history and commit in history for name, commit in REMOVED.items())


def test_bench_run_quick_writes_outside_the_results() -> None:
    """`make bench BENCH_ARGS=--quick` checks every command without touching bench/results/."""
    from bench.catalog import RELEASE
    from bench.run import QUICK_DIR, argv_of

    for run in RELEASE:
        words = argv_of(run, True, QUICK_DIR)
        assert words[0] == sys.executable and not any(w.startswith("bench/results/") for w in words), words
        assert any(w.startswith(str(QUICK_DIR)) for w in words), words


def test_a_merged_result_is_as_current_as_its_oldest_part(tmp_path: Path) -> None:
    """A result written one part at a time (`part_provenance`) is stale when any part's code changed since that
    part was measured, even if the file's own provenance is current; each part's date and commit is shown."""
    from bench.report import currency

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    first = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True,
                           check=True).stdout.split()[0]
    now = {"commit": head, "dirty": False, "when": "2026-01-02T00:00:00+00:00", "depends_on": ["earl_stream/config"]}
    merged = {"provenance": now, "part_provenance": {"old": {**now, "commit": first, "when": "2026-01-01T00:00:00+00:00"}}}
    line, stale = currency(merged, tmp_path / "x.json", [])
    assert stale and f"part `old` measured 2026-01-01 at `{first[:7]}`" in line
    assert currency({"provenance": now, "part_provenance": {"same": now}}, tmp_path / "x.json", [])[1] is False


def test_a_result_whose_parts_ran_on_different_cpus_names_each(tmp_path: Path) -> None:
    """A merged file is not labelled with the CPU of whichever part ran last: the README's stamp names every CPU,
    the page's measured line each part's, and a file measured on the reference CPU alone names none."""
    from bench import report

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    now = {"commit": head, "dirty": False, "when": "2026-01-02T00:00:00+00:00", "depends_on": ["earl_stream/config"],
           "machine": {"cpu": "Intel(R) Xeon(R) Processor"}}
    merged = {"provenance": now, "part_provenance": {"comparison": {**now, "machine": {"cpu": report.REFERENCE_CPU}}}}
    (tmp_path / "m.json").write_text(json.dumps(merged))
    (tmp_path / "one.json").write_text(json.dumps({"provenance": {**now, "machine": {"cpu": report.REFERENCE_CPU}}}))
    assert report.stamp(tmp_path, "m.json").endswith(f"{head[:7]}, {report.REFERENCE_CPU} and Intel Xeon")
    assert report.stamp(tmp_path, "one.json").endswith(head[:7])
    line = report.currency(merged, tmp_path / "m.json", [])[0]
    assert f"Measured 2026-01-02 at `{head[:7]}` on Intel Xeon; part `comparison` measured 2026-01-02 at " \
           f"`{head[:7]}` on {report.REFERENCE_CPU}" in line
    assert "(by part: above)" in report.machine_of(merged)


def test_a_figure_from_one_part_is_stamped_with_that_parts_date_and_cpu(tmp_path: Path) -> None:
    """A figure computed from one part of a merged file names when and where that part ran: a part kept from an
    earlier run its own provenance, any other part the last run's; a figure of the whole file its oldest part."""
    from bench import report

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    last = {"commit": head, "dirty": False, "when": "2026-01-02T00:00:00+00:00", "depends_on": ["earl_stream/config"],
            "machine": {"cpu": "Intel(R) Xeon(R) Processor"}}
    kept = {**last, "when": "2026-01-01T00:00:00+00:00", "machine": {"cpu": report.REFERENCE_CPU}}
    (tmp_path / "m.json").write_text(json.dumps({"provenance": last, "part_provenance": {"comparison": kept}}))
    assert report.stamp(tmp_path, "m.json", "comparison") == f"2026-01-01 {head[:7]}"
    assert report.stamp(tmp_path, "m.json", "staleness") == f"2026-01-02 {head[:7]}, Intel Xeon"
    assert report.stamp(tmp_path, "m.json") == f"2026-01-01 {head[:7]}, {report.REFERENCE_CPU} and Intel Xeon"


def test_a_help_text_is_prose_like_a_docstring() -> None:
    """A config field's help (`_f`'s second argument) and an argparse `help=` are shown, never computed with:
    rewording one leaves a result current; its default, choices or the option's default are code."""
    from bench.provenance import same_code

    old = ('x: int = _f(512, "tokens a chunk holds: 38 MiB at 4,096", minimum=0)\n'
           'ap.add_argument("--reps", type=int, default=3, help="repeats (3: 95% intervals)")\n')
    assert same_code(old, old.replace("38 MiB at 4,096", "a fifth of the memory").replace("3: 95%", "three"))
    assert not same_code(old, old.replace("_f(512", "_f(256"))
    assert not same_code(old, old.replace("minimum=0", "minimum=1"))
    assert not same_code(old, old.replace("default=3", "default=5"))
    assert not same_code(old, old.replace('_f(512, "tokens', '_g(512, "tokens'))  # not a config field: its text counts


def test_a_version_bump_leaves_a_result_current() -> None:
    """A release changes `__version__` and nothing a benchmark measures."""
    from bench.provenance import same_code

    old = '"""Package."""\n__version__ = "0.2.0"\nX = 1\n'
    assert same_code(old, old.replace("0.2.0", "0.3.0"))
    assert not same_code(old, old.replace("X = 1", "X = 2"))
