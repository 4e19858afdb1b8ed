"""The command line's one convention for flags (`earl_stream.cli.flags`): `--param KEY=VALUE` beside `--params
JSON` wherever environment parameters are taken, `--json` on stdout and `--out FILE` to a file, and the old
`eval --json PATH` still parsed for one release with a warning."""

from __future__ import annotations

import argparse

import pytest

from earl_stream.cli.flags import output_of, params_of
from earl_stream.cli.main import build_parser
from earl_stream.errors import ConfigError


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", [("eval", "--model", "m", "--env", "tictactoe"), ("env", "attach", "tictactoe"),
                                     ("env", "serve", "tictactoe")])
def test_every_command_with_environment_params_takes_param_and_params(command: tuple[str, ...]) -> None:
    args = _parse(*command, "--params", '{"size": 500, "name": "a"}', "--param", "size=7", "--param", "hard=true",
                  "--param", "empty=")
    assert params_of(args) == {"size": 7, "name": "a", "hard": True, "empty": ""}  # --param wins, values are YAML
    assert params_of(_parse(*command)) == {}


@pytest.mark.parametrize("bad, message", [(("--params", "[1]"), "must be a JSON object"),
                                          (("--params", "{"), "is not JSON"),
                                          (("--param", "size"), "must look like KEY=VALUE")])
def test_malformed_params_are_refused_by_name(bad: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        params_of(_parse("eval", "--model", "m", "--env", "e", *bad))


def test_json_prints_out_writes_and_json_path_is_deprecated(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("eval", "--model", "m", "--env", "e")
    assert output_of(_parse(*base), "eval") == (False, None)
    assert output_of(_parse(*base, "--json"), "eval") == (True, None)
    assert output_of(_parse(*base, "--out", "r.json"), "eval") == (False, "r.json")
    assert output_of(_parse(*base, "--json", "--out", "r.json"), "eval") == (True, "r.json")
    assert capsys.readouterr().err == ""
    assert output_of(_parse(*base, "--json", "old.json"), "eval") == (False, "old.json")
    err = capsys.readouterr().err
    assert "`--json PATH` is deprecated" in err and "--out old.json" in err
    with pytest.raises(ConfigError, match="name two files"):
        output_of(_parse(*base, "--json", "a.json", "--out", "b.json"), "eval")


def test_json_is_a_flag_wherever_a_command_prints_json() -> None:
    """No command takes `--json` as a path any more (only eval's deprecated spelling still parses one)."""
    for argv in (("status",), ("doctor",), ("runs", "show", "RUN"), ("eval", "--model", "m", "--env", "e")):
        assert _parse(*argv, "--json").json is True


def test_config_overrides_are_taken_wherever_they_stand() -> None:
    """`make run ARGS=...` puts `eval.every=20` before the user's arguments: overrides after an option still count."""
    from earl_stream.cli.main import _parse

    args = _parse(build_parser(), ["up", "eval.every=20", "--config", "x.yaml", "trainer.lr=1", "--steps", "3", "a=b"])
    assert args.overrides == ["eval.every=20", "trainer.lr=1", "a=b"] and args.config == "x.yaml" and args.steps == 3
    with pytest.raises(SystemExit):
        _parse(build_parser(), ["up", "--no-such-flag"])
    with pytest.raises(SystemExit):
        _parse(build_parser(), ["status", "x=1"])  # no overrides there
