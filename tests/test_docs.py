"""The documentation: the configuration and command-line references are what the code declares, the site builds strictly
(every link and anchor resolves), the README stays a README (short, its links resolve, each result it
quotes dated with the commit of its result file), pages written by hand quote no measured figure (those are
generated from the result files) and nothing outside the history names the work that made it.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 15_500


def _reference_module(name: str = "config_reference") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_generated_from_the_code() -> None:
    """docs/configuration.md, regenerated, is byte for byte what is committed: a field added, renamed or
    re-documented without `make docs-reference` fails here."""
    from earl_stream.config import field_help

    text = _reference_module().render()
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert text == committed, "docs/configuration.md is out of date: run `make docs-reference`"
    for name, _ in field_help():  # every leaf field of the run's config has its line
        assert f"**`{name.replace('.0.', '.N.')}`**" in text, name


def test_the_cli_reference_is_generated_from_the_parser() -> None:
    """docs/cli.md, regenerated from `earl-stream`'s parser, is byte for byte what is committed: a command or
    flag added, renamed or re-documented without `make docs-reference` fails here. Every command and
    subcommand has its section."""
    from earl_stream.cli.main import build_parser

    module = _reference_module("cli_reference")
    text = module.render()
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert text == committed, "docs/cli.md is out of date: run `make docs-reference`"

    def paths(parser: Any, path: str) -> list[str]:
        return [path] + [p for name, sub in module._subparsers(parser) for p in paths(sub, f"{path} {name}")]

    commands = paths(build_parser(), "earl-stream")
    assert {"earl-stream eval", "earl-stream env attach", "earl-stream runs compare"} <= set(commands)
    for path in commands:
        assert f"# `{path}`\n" in text, path
    mkdocs_nav = (ROOT / "mkdocs.yml").read_text()
    assert "cli.md" in mkdocs_nav and "(cli.md)" in (ROOT / "docs" / "index.md").read_text()


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("pymdownx") is None:
        pytest.skip("mkdocs is not installed (it comes with the test and docs extras: pip install -e '.[docs]')")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=300)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`make docs`: every page in the nav, every link and anchor resolves."""
    out = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """The strict build is strict: a copy of the site with one link to a missing anchor does not build."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "install.md"
    page.write_text(page.read_text() + "\nSee [nowhere](quickstart.md#no-such-heading).\n")
    out = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "no-such-heading" in out.stdout + out.stderr, out.stdout + out.stderr


def _github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading (what the site's toc slugify also does)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= README_MAX_BYTES, f"README.md is {len(readme.encode())} bytes: move depth to docs/"
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if re.match(r"https?://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            if anchor not in {_github_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"README.md links to what does not exist: {broken}"


MEASURED_FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?x (?:faster|slower|smaller|larger|more|fewer|less|over|against|speed)"
    r"|\[[-+]?\d+\.\d+%?, [-+]?\d+\.\d+%?\]")
GENERATED_PAGES = {"results.md", "BENCHMARKS.md", "cli.md", "configuration.md", "history.md"}


def _hand_written_text() -> dict[str, str]:
    """README outside its generated blocks and every docs page written by hand."""
    readme = re.sub(r"<!-- (\w+):begin .*?<!-- \1:end -->", "", (ROOT / "README.md").read_text(), flags=re.S)
    assert "bench/results/" not in readme, "the README's generated blocks were not found"
    pages = {"README.md": readme}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.name not in GENERATED_PAGES and "benchmarks" not in page.relative_to(ROOT / "docs").parts:
            pages[str(page.relative_to(ROOT))] = page.read_text()
    return pages


def test_hand_written_pages_quote_no_measured_figure() -> None:
    """A measured ratio or interval appears only on the pages generated from the result files (README's results
    block, docs/results.md, docs/BENCHMARKS.md), which the page tests compare with their files: a figure typed by
    hand would drift from its file unnoticed when the result is measured again."""
    quoted = [f"{name}: {m.group(0)!r}" for name, text in _hand_written_text().items()
              for m in MEASURED_FIGURE.finditer(text)]
    assert not quoted, f"measured figures typed by hand (cite docs/results.md instead): {quoted}"


def test_no_issue_numbers_in_docs_docstrings_or_results() -> None:
    """History lives in CHANGELOG.md and docs/history.md; the code, the other docs and the result files say what
    is, not which piece of work made it so."""
    work_log = re.compile(r"\b[Ii]ssues? #?\d+\b|\b[Ss]ession \d+\b")
    files = [ROOT / "README.md", *(ROOT / "bench" / "results").glob("*.json")]
    for folder, suffixes in (("earl_stream", {".py"}), ("bench", {".py"}), ("envs", {".py"}),
                             ("scripts", {".py", ".sh"}), ("configs", {".yaml"}), ("docs", {".md"})):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in suffixes and p.name != "history.md"]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in files
             for m in work_log.finditer(p.read_text(errors="replace"))]
    assert not found, f"work-log references outside the history: {found}"
