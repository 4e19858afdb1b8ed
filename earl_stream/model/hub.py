"""Models named by a Hugging Face Hub id (`model.path=org/name`, `model.revision`): resolved once to a
commit and a manifest of its files, then found in each host's own cache and checked against it.

This module owns telling a Hub id from a local folder (`is_hub_model`), the one resolution that `up`
(or a supervisor started by hand) does before any worker starts (`pin_model`: the branch or tag becomes
a commit, and the sha256 of every file of that snapshot becomes `model.manifest`, both in the run's
config), and what every process does with that pinned triple (`hub_snapshot`: repo id, commit and
manifest to a local snapshot directory, downloaded when online, refused when a file differs). A worker
on another host gets the triple with the run's config, never a path of the supervisor's host.

Loading the directory is `earl_stream.model.loading`'s. Whether the network may be used is the user's
setting (HF_HUB_OFFLINE=1), read at each call, never forced here; local folders and the embedded model
never reach this module's downloads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from earl_stream.errors import ModelError

if TYPE_CHECKING:
    from earl_stream.config.run import RunConfig
    from earl_stream.config.training import ModelConfig

__all__ = ["ALLOW_PATTERNS", "HubModel", "hub_cache_dir", "hub_problems", "hub_snapshot", "is_hub_id",
           "is_hub_model", "local_model_dir", "manifest_of", "pin_model", "resolve"]

log = logging.getLogger(__name__)

# What a run needs of a model repo: configs, tokenizer files, chat template, safetensors weights (no .bin,
# .gguf, .onnx or other formats' copies of the same weights).
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REVISION = re.compile(r"[\w][\w./+-]*")


@dataclasses.dataclass(frozen=True)
class HubModel:
    """A Hub model pinned to a commit: `path` is this host's snapshot directory of it."""

    repo_id: str
    commit: str  # 40 hex digits
    manifest: dict[str, str]  # file path in the repo -> sha256 hex of its bytes
    path: Path


def is_hub_id(path: str) -> bool:
    """`path` looks like `org/name` and names no existing local file or folder (a local folder wins)."""
    return bool(_HUB_ID.fullmatch(path)) and not Path(path).expanduser().exists()


def is_hub_model(model: ModelConfig) -> bool:
    """The model section names a Hub model: pinned (a manifest) or an `org/name` that is no local folder."""
    return bool(model.manifest) or is_hub_id(model.path)


def hub_cache_dir() -> Path:
    """The Hub cache of this process's environment, read now: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (huggingface_hub reads them once at import; tests and users may set them later)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _missing(repo_id: str, revision: str, exc: BaseException) -> ModelError:
    """The one error of a Hub model this host cannot get, naming everything that can be set."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    from earl_stream.model.loading import one_line

    if isinstance(exc, GatedRepoError):
        why = "it is gated: accept its terms on the Hub, then set HF_TOKEN to a token of that account"
    elif isinstance(exc, RepositoryNotFoundError):
        why = "the Hub has no such model, or it is private (then set HF_TOKEN)"
    elif isinstance(exc, RevisionNotFoundError):
        why = f"it has no revision {revision!r}"
    elif _offline():
        why = f"HF_HUB_OFFLINE=1 and the cache {hub_cache_dir()} does not hold that revision of it"
    else:
        why = f"neither the Hub nor the cache {hub_cache_dir()} gave it ({one_line(exc)})"
    return ModelError(
        f"model.path={repo_id} (model.revision={revision}): cannot get this Hugging Face model: {why}. Check the id "
        "(org/name, or a local folder); set model.revision to an existing branch, tag or commit; to run offline, "
        f"point HF_HOME (or HF_HUB_CACHE) at a cache that holds it (`hf download {repo_id}`) with HF_HUB_OFFLINE=1; "
        "for a gated or private model set HF_TOKEN")


def _download(repo_id: str, revision: str) -> Path:
    """The snapshot directory of `repo_id` at `revision` in this host's cache, downloaded if online."""
    from huggingface_hub import snapshot_download

    offline = _offline()
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=list(ALLOW_PATTERNS),
                                   cache_dir=hub_cache_dir(), local_files_only=offline)
    except Exception as exc:  # huggingface_hub's errors, httpx's, OSError: all mean "not available here"
        raise _missing(repo_id, revision, exc) from None
    return Path(folder)


@lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_of(folder: Path) -> dict[str, str]:
    """sha256 of every file of the snapshot `folder` that a run uses (ALLOW_PATTERNS), by repo path.
    Hashed from the bytes (once per file size and mtime in this process): a blob edited in place is seen."""
    from huggingface_hub.utils import filter_repo_objects

    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    out = {}
    for name in filter_repo_objects(names, allow_patterns=list(ALLOW_PATTERNS)):
        st = (folder / name).stat()
        out[name] = _sha256(str((folder / name).resolve()), st.st_size, st.st_mtime_ns)
    return out


def resolve(repo_id: str, revision: str = "") -> HubModel:
    """`repo_id` at `revision` (default main) to its commit, this host's snapshot and its manifest."""
    folder = _download(repo_id, revision or "main")
    commit = folder.name
    if not _COMMIT.fullmatch(commit):
        raise ModelError(f"model.path={repo_id}: the Hub cache gave {folder}, which is not a snapshot of a commit")
    manifest = manifest_of(folder)
    if "config.json" not in manifest:
        raise ModelError(f"model.path={repo_id} at commit {commit} has no config.json; it is not a Hugging Face "
                         "model repository")
    return HubModel(repo_id, commit, manifest, folder)


def hub_snapshot(repo_id: str, commit: str, manifest: Mapping[str, str]) -> Path:
    """This host's snapshot of `repo_id` at `commit` (downloaded if online), refused with a ModelError naming
    each file whose bytes differ from `manifest` (the supervisor's), is missing, or is not in it."""
    folder = _download(repo_id, commit)
    here = manifest_of(folder)
    problems = [f"{name} differs (sha256 {here[name][:12]}..., the run's {want[:12]}...)"
                for name, want in sorted(manifest.items()) if name in here and here[name] != want]
    problems += [f"{name} is missing" for name in sorted(set(manifest) - set(here))]
    problems += [f"{name} is not in the run's copy" for name in sorted(set(here) - set(manifest))]
    if problems:
        raise ModelError(f"model.path={repo_id} at commit {commit}: this host's copy in {folder} is not the one the "
                         f"run was started with: {'; '.join(problems)} (remove it from the cache, e.g. `hf cache "
                         "rm`, to download it again)")
    return folder


def local_model_dir(model: ModelConfig) -> Path | None:
    """The directory every role loads `model` from: a local folder as given, a pinned Hub model's verified
    snapshot (`hub_snapshot`), an unpinned Hub id resolved now; None for the embedded model (empty path)."""
    if not model.path:
        return None
    if model.manifest:
        return hub_snapshot(model.path, model.revision, model.manifest)
    if is_hub_id(model.path):
        return resolve(model.path, model.revision).path
    return Path(model.path)


def pin_model(cfg: RunConfig) -> RunConfig:
    """`cfg` with a Hub model pinned: model.revision the commit it resolves to, model.manifest its files'
    sha256 (what every worker checks its own copy against). Unchanged for local folders, the embedded
    model, and a model already pinned."""
    model = cfg.model
    if model.manifest or not is_hub_id(model.path):
        return cfg
    hub = resolve(model.path, model.revision)
    log.info("model %s (revision %s) is commit %s: %d files, from %s", hub.repo_id, model.revision or "main",
             hub.commit, len(hub.manifest), hub.path)
    return dataclasses.replace(cfg, model=dataclasses.replace(model, revision=hub.commit, manifest=hub.manifest))


def hub_problems(model: ModelConfig) -> list[str]:
    """What is wrong with the Hub fields of the model section (checked at load; [] when all is well)."""
    out = []
    hub = is_hub_model(model)
    if model.revision and not _REVISION.fullmatch(model.revision):
        out.append(f"model.revision: {model.revision!r} is not a branch, tag or commit name")
    elif model.revision and not hub:
        what = f"the local folder {model.path}" if model.path else "the embedded model"
        out.append(f"model.revision={model.revision} applies to a Hugging Face Hub id (model.path=org/name), not "
                   f"to {what}")
    if model.manifest:
        if not _COMMIT.fullmatch(model.revision):
            out.append("model.manifest is set by `up` together with the commit in model.revision; leave it empty")
        bad = [name for name, digest in model.manifest.items() if not (isinstance(digest, str)
                                                                        and _SHA256.fullmatch(digest))]
        if bad:
            out.append(f"model.manifest: {bad[:3]} have no sha256 hex digest")
    return out
