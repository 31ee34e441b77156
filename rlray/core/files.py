"""Errors of file writes that name the file: a full disk's "[Errno 28] No space left on
device" alone does not say which of a run's files (or disks) ran out."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Re-raises an OSError of the block that names no file as one that names `path`
    (errno and message kept). Errors of write() and of pyarrow and torch writers come
    without a file name."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        reason = err.strerror or str(err) or type(err).__name__
        raise OSError(err.errno, reason, str(path)) from err
