"""Where a benchmark result came from: when, at which commit, on what machine, measuring which code.

Every benchmark writes its JSON through `write_result`, which adds a `provenance` object itself
(nothing in it is typed by hand):

- `when`: UTC time of the write (ISO 8601);
- `commit`: the checkout's HEAD when the benchmark started (this module's import), with `dirty: true`
  when tracked files (prose and results aside) differed from it then, or when HEAD or a tracked file changed while it ran (a long
  benchmark that starts processes along the way may have measured a mix: it names no single commit);
- `machine`: CPU model, cores, memory, OS, Python and torch versions, and the GPU name, count and
  driver where CUDA is available;
- `depends_on`: the paths (files or folders, relative to the repository) whose code the result
  measures. `bench/report.py` marks a result stale when the code of any of them (docstrings and comments
  aside) differs from `commit`.

No absolute paths of this machine go into a result: `relative` turns one into a repository path or
its file name.
"""

from __future__ import annotations

import ast
import datetime as _dt
import functools
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def machine() -> dict[str, Any]:
    """The machine a result was measured on (no host names, no paths)."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "memory_bytes": _memory_bytes(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["cuda"] = torch.version.cuda
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30)
            if driver.returncode == 0 and driver.stdout.strip():
                info["driver"] = driver.stdout.strip().splitlines()[0]
    except (ImportError, OSError, subprocess.TimeoutExpired):
        pass
    return info


def _checkout() -> tuple[str, str]:
    """HEAD and the tracked code's differences from it (a diff's text: '' for a clean checkout); results,
    docs and the README aside (a benchmark writes results as it goes; prose measures nothing)."""
    return _git("rev-parse", "HEAD"), _git("diff", "HEAD", "--", ".", ":(exclude)bench/results", ":(exclude)docs",
                                           ":(exclude)*.md")


_STARTED = _checkout()  # the code a benchmark measures is the code it started from


def measured_at() -> str:
    """`DATE SHORT_COMMIT` of the code a benchmark measures (the HEAD it started from), `+dirty` when its tracked
    code differed from that commit then or changed while it ran: a stamp for a row of a result that merges runs."""
    head, diff = _STARTED
    dirty = bool(diff) or _checkout() != _STARTED
    return f"{_dt.date.today().isoformat()} {head[:7] or 'unknown'}{'+dirty' if dirty else ''}"


def provenance(depends_on: list[str]) -> dict[str, Any]:
    """The `provenance` object of a result measuring the code under `depends_on` (repository paths)."""
    missing = [p for p in depends_on if not (ROOT / p).exists()]
    if missing:
        raise ValueError(f"depends_on names paths that do not exist in the repository: {missing}")
    head, diff = _STARTED
    out = {
        "when": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "commit": head,
        "dirty": bool(diff) or _checkout() != _STARTED,
        "machine": machine(),
        "depends_on": sorted(depends_on),
    }
    if _checkout()[0] != head:
        out["commit_at_write"] = _checkout()[0]  # the checkout moved on while it ran
    return out


def git(*args: str) -> tuple[int, str]:
    """`git` in the repository: (return code, output)."""
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.returncode, done.stdout.strip()


def changed_since(commit: str, depends_on: list[str], not_measured: list[str] = ()) -> list[str]:  # type: ignore[assignment]
    """The measured paths whose code in this checkout differs from `commit` (None-safe: [] if unknown), less
    the `not_measured` paths inside them (code the benchmark never runs, e.g. another engine). A Python file whose
    only changes are in docstrings and comments has the same code (`same_code`): the result stays current."""
    if not commit or not depends_on:
        return []
    # a measured path gone since (moved or deleted) shows as changed: git names its deletion
    rc, out = git("diff", "--name-only", commit, "--", *depends_on, *(f":(exclude){p}" for p in not_measured))
    if rc != 0:
        return []
    return sorted(p for p in out.splitlines() if not _prose_only(commit, p))


@functools.cache  # results measured at one commit share its files: one `git show` each
def _prose_only(commit: str, path: str) -> bool:
    """Whether the Python file `path` differs from its version at `commit` in docstrings and comments only."""
    if not path.endswith(".py") or not (ROOT / path).is_file():
        return False
    rc, old = git("show", f"{commit}:{path}")
    return rc == 0 and same_code(old, (ROOT / path).read_text())


def same_code(old: str, new: str) -> bool:
    """Whether two Python sources are the same program: equal syntax trees once every module, class and function
    docstring and every help text is left out (comments and layout are not in the tree). A help text is a string
    passed as `help=` (argparse) or as the second argument of a config field (`earl_stream.config.fields.field`,
    imported as `_f`): `--help` and the docs show it, nothing computes with it. Unparsable source is never the
    same."""
    try:
        return _code_tree(old) == _code_tree(new)
    except (SyntaxError, ValueError):
        return False


def _code_tree(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) and \
                isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "help" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    kw.value = ast.Constant("")
            if isinstance(node.func, ast.Name) and node.func.id == "_f" and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                node.args[1] = ast.Constant("")
    # a release's version number is not measured code: bumping it leaves every result current
    tree.body = [n for n in tree.body if not (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(
        n.targets[0], ast.Name) and n.targets[0].id == "__version__" and isinstance(n.value, ast.Constant))]
    return ast.dump(tree)


def run_stamp() -> dict[str, Any]:
    """Where one run of a benchmark that merges runs into one file (across invocations: `--resume`, `--only`) was
    measured: the commit its code came from (the HEAD the benchmark started from), whether the tracked code differed
    from that commit, and the CPU. `other_measurement` reads it back."""
    head, diff = _STARTED
    return {"commit": head, "dirty": bool(diff) or _checkout() != _STARTED, "cpu": _cpu_model()}


def other_measurement(stamp: dict[str, Any] | None, depends_on: list[str]) -> str:
    """Why a run stamped `stamp` (`run_stamp`) cannot stand beside runs measured now ("" when it can): no stamp, a
    dirty checkout, another CPU, or measured code (`depends_on`) that changed since its commit."""
    if not stamp or not stamp.get("commit"):
        return "no record of the code it ran"
    if stamp.get("dirty"):
        return f"measured from uncommitted changes to {stamp['commit'][:7]}"
    if stamp.get("cpu") != _cpu_model():
        return f"measured on another CPU ({stamp.get('cpu')})"
    if git("cat-file", "-e", f"{stamp['commit']}^{{commit}}")[0] != 0:
        return f"measured at {stamp['commit'][:7]}, a commit this history lacks"
    changed = changed_since(stamp["commit"], depends_on)
    return f"measured at {stamp['commit'][:7]}; changed since: {', '.join(changed)}" if changed else ""


def relative(path: str | Path) -> str:
    """A path as the repository names it (or its file name when it lies outside): no machine paths."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return p.name


def catalogued_depends_on(out: str | Path) -> list[str]:
    """The code paths `bench/catalog.py` names for the benchmark whose results files match `out`'s name (the
    whole package for a file no benchmark there writes)."""
    import fnmatch
    import sys

    if str(ROOT) not in sys.path:  # run as a script from bench/: the catalog imports as bench.catalog
        sys.path.insert(0, str(ROOT))
    from bench.catalog import BENCHMARKS

    name = Path(out).name
    for bench in BENCHMARKS:
        if any(fnmatch.fnmatch(name, pattern) for pattern in bench["files"]):
            return list(bench["depends_on"])
    return ["earl_stream"]  # not a catalogued result (a scratch run): it measures the package as a whole


_ABS_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)*[\w.@+-]+")


def _scrub_path(match: re.Match[str]) -> str:
    path = Path(match.group(0))
    cache = Path(os.environ.get("EARL_STREAM_CACHE", Path.home() / ".cache" / "earl_stream"))
    for base, shown in ((ROOT, ""), (cache, "$EARL_STREAM_CACHE/")):
        try:
            return shown + str(path.relative_to(base))
        except ValueError:
            continue
    return "/".join(path.parts[-3:]) if len(path.parts) > 3 else "/".join(path.parts[1:])


def scrub(node: Any) -> Any:
    """`node` with this machine's absolute paths made relative (to the repository, to the model cache, or cut to
    their last two parts), so that no result holds a machine path."""
    if isinstance(node, str):
        return _ABS_PATH.sub(_scrub_path, node) if "/" in node else node
    if isinstance(node, dict):
        return {k: scrub(v) for k, v in node.items()}
    if isinstance(node, list):
        return [scrub(v) for v in node]
    return node


def backfill(path: Path) -> bool:
    """Give a result written before `provenance` existed the one that git knows: the commit that last wrote it,
    that commit's date, and the catalogued `depends_on` (`machine` stays unrecorded); scrubs machine paths.
    False when the file already has a provenance or is not committed."""
    data = json.loads(path.read_text())
    if "provenance" in data:
        return False
    found = _git("log", "-1", "--format=%H %cI", "--", str(path.resolve().relative_to(ROOT)))
    if not found:
        return False
    commit, when = found.split()
    data = scrub(data)
    data["provenance"] = {"when": when, "commit": commit, "dirty": False, "machine": None, "backfilled": True,
                          "depends_on": sorted(catalogued_depends_on(path))}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return True


def scrub_file(path: Path) -> bool:
    """Scrub the machine paths out of a results file in place (its numbers and layout untouched); False when it
    held none."""
    text = path.read_text()
    data = json.loads(text)
    clean = scrub(data)
    if clean == data:
        return False
    second = text.split("\n", 2)[1] if text.count("\n") > 1 else ""
    indent = (len(second) - len(second.lstrip(" "))) or None  # the file's own indentation
    path.write_text(json.dumps(clean, indent=indent, default=str) + "\n")
    return True


def write_result(out: str | Path, result: dict[str, Any], depends_on: list[str] | None = None, indent: int = 2,
                 measured: dict[str, Any] | None = None) -> Path:
    """Write `result` as JSON to `out` with its `provenance` added (the code it measures: `depends_on`, else
    what bench/catalog.py names for that file); returns the path written. `measured`: the provenance of the
    measurement when this only recomputes a summary of it (kept, with `summary_rebuilt` saying when and where)."""
    payload = scrub(dict(result))
    now = provenance(depends_on if depends_on is not None else catalogued_depends_on(out))
    payload["provenance"] = now if not measured else {
        **measured, "summary_rebuilt": {"when": now.get("when"), "commit": now.get("commit"), "dirty": now.get("dirty")}}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=str) + "\n")
    return path


def keep_parts(previous: dict[str, Any], result: dict[str, Any], parts: dict[str, tuple[str, ...]],
               shared: tuple[str, ...] = ()) -> dict[str, Any]:
    """`result` with the keys of each of `parts` (parts this run did not measure) kept from `previous`, the file it
    replaces, where `previous` holds that part (one of its keys set; `shared` keys, which describe more than one
    part, do not count), and the provenance each kept part was measured at (`previous`'s `part_provenance` entry,
    else its own provenance) in `part_provenance`."""
    merged, known, kept = dict(result), previous.get("part_provenance") or {}, {}
    for part, keys in parts.items():
        if any(previous.get(k) is not None for k in keys if k not in shared):
            merged.update({k: previous[k] for k in keys if k in previous})
            if where := known.get(part) or previous.get("provenance"):
                kept[part] = where
    if kept:
        merged["part_provenance"] = kept
    return merged


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Backfill the provenance of results written before it existed, and "
                                             "scrub machine paths out of results that have one.")
    ap.add_argument("files", nargs="+", type=Path, help="results JSON files")
    for f in ap.parse_args().files:
        print(f"{f}: {'backfilled' if backfill(f) else 'scrubbed' if scrub_file(f) else 'unchanged'}")
