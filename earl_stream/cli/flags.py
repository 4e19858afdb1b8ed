"""The command line's shared flags, one convention for every command (docs/cli.md):

- `--json` prints machine-readable output (JSON) on stdout, and nothing else goes there;
- `--out FILE` writes a file;
- environment parameters are `--param KEY=VALUE` (repeatable; VALUE is read as YAML, so `size=500` is a
  number) plus `--params JSON` where a whole object is natural; `--param` wins over `--params` key by key.

An old spelling keeps working for one release and says so on stderr (`deprecated`): `eval --json PATH`
(now `--out PATH`). The commands' own modules call these; parsing the values is left to them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from earl_stream.errors import ConfigError

PARAM_HELP = ("an environment parameter, KEY=VALUE (VALUE read as YAML: 500 is a number, true a boolean); "
              "repeatable, and each wins over the same key of --params")
PARAMS_HELP = "environment parameters as one JSON object, e.g. '{\"size\": 500}'"


def add_param_args(p: argparse.ArgumentParser, params_help: str = PARAMS_HELP) -> None:
    """`--param KEY=VALUE` (repeatable) and `--params JSON` on `p`; read them back with `params_of`."""
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help=PARAM_HELP)
    p.add_argument("--params", default="", metavar="JSON", help=params_help)


def params_of(args: argparse.Namespace) -> dict[str, Any]:
    """The parameters `--params` and then every `--param` give (ConfigError names a malformed one)."""
    out: dict[str, Any] = {}
    if args.params:
        try:
            whole = json.loads(args.params)
        except ValueError as exc:
            raise ConfigError(f"--params is not JSON: {exc}") from None
        if not isinstance(whole, dict):
            raise ConfigError(f"--params must be a JSON object, got {args.params!r}")
        out.update(whole)
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--param {item!r} must look like KEY=VALUE")
        try:
            out[key] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--param {item!r}: the value is not valid YAML: {exc}") from None
    return out


def add_output_args(p: argparse.ArgumentParser, what: str) -> None:
    """`--json` (print `what` as JSON on stdout) and `--out FILE` (write it there). `--json PATH`, the old
    spelling of `--out PATH`, still parses: `output_of` turns it into `--out` with a warning."""
    p.add_argument("--json", nargs="?", const=True, default=False, metavar="PATH",
                   help=f"print {what} as JSON on stdout (the human summary goes to stderr); "
                        "`--json PATH` is the deprecated spelling of `--out PATH`")
    p.add_argument("--out", metavar="FILE", help=f"write {what} as JSON to FILE")


def output_of(args: argparse.Namespace, command: str) -> tuple[bool, str | None]:
    """(print JSON on stdout, file to write) from `--json` and `--out`, warning on stderr about `--json PATH`."""
    if isinstance(args.json, str):
        print(f"earl-stream {command}: warning: `--json PATH` is deprecated and will be removed in the next "
              f"release: use `--out {args.json}` (`--json` alone now prints the JSON on stdout)", file=sys.stderr)
        if args.out and args.out != args.json:
            raise ConfigError(f"--json {args.json} and --out {args.out} name two files: give --out alone")
        return False, args.out or args.json
    return bool(args.json), args.out
