"""The command line both generated reference pages share (scripts/config_reference.py, scripts/cli_reference.py):
write the page, or with --check exit 1 when the committed page differs from what the code generates."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def reference_main(doc: str, render: Callable[[], str], out: Path, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the code")
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            sys.stderr.write(f"{args.out} is out of date: run `make docs-reference`\n")
            return 1
        return 0
    args.out.write_text(text)
    return 0
