"""Files that must survive a crash whole: written under a temporary name, fsync'd, renamed into place,
and the directory entry fsync'd, so a reader finds the old bytes or the new ones, never a mix.
Used by the supervisor's snapshot (`supervisor/wal.py`) and the rollout workers' persisted experience
(`store/durable.py`)."""

from __future__ import annotations

import os
from pathlib import Path


def write_durably(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably (see the module docstring). OSError on failure."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
