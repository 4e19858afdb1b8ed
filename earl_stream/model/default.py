"""The embedded default run's model: a tiny model warm-started on a game, built once per machine.

This module owns where the cached build lives (`default_model_dir`) and building it exactly once
under a file lock, so that concurrent callers wait for one build and never see a half-written model
(`ensure_default_model`). What is built is `earl_stream.model.tiny.init_model` followed by
`earl_stream.model.warmstart.warm_start` on the game, which is named by an environment spec and
resolved through the environment registry, not imported here. A game whose observations are pictures
(`tictactoe_image`) gets a tiny vision-language model instead (`model.tiny_vlm.init_vlm_model`, Idefics3 with a
picture of 9 image tokens, one per 32-pixel patch), warm-started the same way from its pictures.

`model.path` names an embedded model as `default:<game>` (`embedded_game`); an empty path is
`default:tictactoe`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_GAME", "DEFAULT_MODEL_NAME", "DEFAULT_WARM_START_STEPS", "EMBEDDED_PREFIX", "cache_dir",
           "default_model_dir", "embedded_game", "ensure_default_model", "shows_pictures"]

logger = logging.getLogger(__name__)

DEFAULT_GAME = "tictactoe"
# Bump the version whenever the build recipe changes: a cached older build is never reused.
_RECIPE = "warm-v4"
DEFAULT_MODEL_NAME = f"{DEFAULT_GAME}-{_RECIPE}"
# v4: 1,350 supervised steps (v3: 450). Sampled at temperature 1, its moves are legal 0.984 of the time (0.972),
# and RL from it holds more of what it learns (the tuning runs in docs/history.md).
DEFAULT_WARM_START_STEPS = 1350
# A game shown as pictures: a vision-language model's recipe, versioned on its own.
_VISION_RECIPE = "vlm-warm-v1"
VISION_MODEL = dict(family="idefics3", hidden_size=128, num_layers=4, intermediate_size=512, vision_hidden_size=64,
                    image_size=96, initializer_range=0.1)
EMBEDDED_PREFIX = "default:"


def embedded_game(path: str) -> str | None:
    """The game whose embedded model `model.path` names: "" -> the default game, "default:<game>" -> that game;
    None for any other path (a folder or a Hub id)."""
    if not path:
        return DEFAULT_GAME
    if not path.startswith(EMBEDDED_PREFIX):
        return None
    game = path[len(EMBEDDED_PREFIX):].strip()
    if not game:
        from earl_stream.errors import ConfigError
        raise ConfigError(f"model.path={path!r} names no game: write default:<game>, e.g. default:tictactoe_image")
    return game


def shows_pictures(game: str) -> bool:
    """Whether `game`'s first observation carries pictures (then its embedded model is a vision-language one)."""
    from earl_stream.env import env_reset, resolve_env
    from earl_stream.env.api import run_now
    from earl_stream.env.images import split_observation

    return bool(split_observation(run_now(env_reset(resolve_env(game)(), 0)))[1])


def cache_dir() -> Path:
    """`$EARL_STREAM_CACHE` (default `~/.cache/earl_stream`): built and imported models live under models/."""
    root = os.environ.get("EARL_STREAM_CACHE") or Path.home() / ".cache" / "earl_stream"
    return Path(root).expanduser()


def default_model_dir(game: str = DEFAULT_GAME, warm_start_steps: int = DEFAULT_WARM_START_STEPS) -> Path:
    """`cache_dir()/models/<game>-warm-v4`, e.g. `~/.cache/earl_stream/models/tictactoe-warm-v4`; a warm start of
    other than the default steps (`model.warm_start_steps`) is another model: `<game>-warm-v4-<steps>steps`. A game
    shown as pictures: `<game>-vlm-warm-v1` (e.g. `tictactoe_image-vlm-warm-v1`)."""
    suffix = "" if warm_start_steps == DEFAULT_WARM_START_STEPS else f"-{warm_start_steps}steps"
    recipe = _VISION_RECIPE if game != DEFAULT_GAME and shows_pictures(game) else _RECIPE
    return cache_dir() / "models" / f"{game}-{recipe}{suffix}"


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# The default build ships with the package (a 4.5 MB tar of the built directory): a first run starts training
# within a minute instead of warm-starting for minutes. It is named like the cached build, so a recipe bump (a new
# _RECIPE) never picks up an old copy.
PACKAGED_MODELS = Path(__file__).resolve().parent


def packaged_model(name: str) -> Path | None:
    """The tar of the model of that name shipped in the package (`earl_stream/model/<name>.tar`), or None."""
    found = PACKAGED_MODELS / f"{name}.tar"
    return found if found.is_file() else None


def _unpack(archive: Path, name: str, into: Path) -> None:
    """Extract `archive` (one top-level directory `name`, plain files only) into `into`."""
    import tarfile

    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.isdir() and parts == (name,):
                continue
            if not member.isfile() or len(parts) != 2 or parts[0] != name:
                raise ValueError(f"{archive}: unexpected member {member.name!r}")
            source = tar.extractfile(member)
            assert source is not None
            (into / parts[1]).write_bytes(source.read())


def ensure_default_model(*, game: str = DEFAULT_GAME, warm_start_steps: int = DEFAULT_WARM_START_STEPS,
                         warm_start_seconds: float = 1800) -> Path:
    """Return `default_model_dir(game, warm_start_steps)`, copying it from the package where one of that name ships
    with it, else building it first (init + warm start on `game`) if it is not there yet.

    Built in a temporary sibling directory and renamed into place under an fcntl lock, so
    concurrent callers wait for one build and no one ever sees a half-written model.
    """
    final = default_model_dir(game, warm_start_steps)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / "config.json").is_file():
            return final
        from earl_stream.model.tiny import init_model
        from earl_stream.model.tiny_vlm import init_vlm_model
        from earl_stream.model.warmstart import warm_start

        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
        shipped = packaged_model(final.name)
        if shipped is not None:
            try:
                _unpack(shipped, final.name, tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.chmod(tmp, 0o755)
            os.rename(tmp, final)
            logger.info("the default model %s: copied from the package to %s", final.name, final)
            return final
        try:
            started = time.monotonic()
            if final.name.startswith(f"{game}-{_VISION_RECIPE}"):
                init_vlm_model(tmp, **VISION_MODEL)  # type: ignore[arg-type]
            else:
                init_model(tmp)
            # a fixed number of steps (not a time budget): the same model on a busy or an idle machine
            report = warm_start(tmp, game, seconds=warm_start_seconds, max_steps=warm_start_steps, batch_size=16)
            meta: dict[str, Any] = {"name": final.name, "warm_start": report.as_dict(),
                                    "build_seconds": round(time.monotonic() - started, 1)}
            (tmp / "earl_stream_model.json").write_text(json.dumps(meta, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cached model is meant to be shared
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("built the default model in %s", final)
    return final
