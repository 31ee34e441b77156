"""rlray's cache folder, and safe writes into it from several processes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """Returns rlray's cache folder: $RLRAY_CACHE_DIR, else ~/.cache/rlray."""
    return Path(os.environ.get("RLRAY_CACHE_DIR") or Path.home() / ".cache" / "rlray")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on `path` (made if missing) while the block runs: one
    process at a time, on this node."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomically(target: Path, text: str) -> None:
    """Writes `text` to `target` through a temporary file, so that a reader never sees
    half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False) as out:
        out.write(text)
    os.replace(out.name, target)
