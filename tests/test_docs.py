"""The documentation: the configuration and command-line references are what the code declares, the site builds strictly
(every link and anchor resolves), and the README stays a README (short, its links resolve, each result it
quotes dated with the commit of its result file).
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


