"""EpisodeStore: every episode of a run, appended to Parquet files in batches.

Files are partitioned by run and date, `<root>/run=<run_id>/date=<YYYY-MM-DD>/part-*.parquet`
(hive style, so pyarrow.dataset reads them back with those two columns). Rows are
buffered and written `rows_per_file` at a time (or when `flush_every_s` has passed), never
a file per episode; each file is written under a temporary name and renamed, so a reader
never sees half a file. With an S3 (or pre-signed URL) sink the finished files go to the
uploader, which ships them off the training path and keeps them in a local spool until
they are uploaded.

A plain class: tests use it in-process; rlray.actors runs it as the `store` actor.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import pyarrow.parquet as pq

from rlray.config import StoreConfig
from rlray.episode import Episode, to_table


class Uploader(Protocol):
    def submit(self, local_file: Path, key: str) -> None: ...
    def close(self, timeout_s: float) -> list[Path]: ...
    def pending(self) -> int: ...


@dataclass
class StoreStats:
    """What the store has done so far (small; goes into metrics and the summary)."""

    episodes_written: int
    files_written: int
    buffered: int
    uploads_pending: int


class EpisodeStore:
    """Buffers episodes and writes them as Parquet files under `root`."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        rows_per_file: int = 2048,
        flush_every_s: float = 60.0,
        uploader: Uploader | None = None,
    ):
        self.root = Path(root)
        self.run_id = run_id
        self.rows_per_file = rows_per_file
        self.flush_every_s = flush_every_s
        self.uploader = uploader
        self._buffer: list[Episode] = []
        self._last_flush = time.monotonic()
        self.episodes_written = 0
        self.files_written = 0

    def append(self, episodes: list[Episode]) -> None:
        """Buffers the episodes; writes a file once enough rows or time have gathered."""
        self._buffer.extend(episodes)
        while len(self._buffer) >= self.rows_per_file:
            self._write_file(self._take(self.rows_per_file))
        if self._flush_due():
            self.flush()

    def _flush_due(self) -> bool:
        return time.monotonic() - self._last_flush >= self.flush_every_s

    def flush(self) -> list[Path]:
        """Writes every buffered episode now; returns the files written."""
        written = []
        while self._buffer:
            written.append(self._write_file(self._take(self.rows_per_file)))
        self._last_flush = time.monotonic()
        return written

    def _take(self, count: int) -> list[Episode]:
        rows, self._buffer = self._buffer[:count], self._buffer[count:]
        return rows

    def _write_file(self, episodes: list[Episode]) -> Path:
        date = datetime.now(UTC).strftime("%Y-%m-%d")
        relative = Path(f"run={self.run_id}", f"date={date}", f"part-{_file_stamp()}.parquet")
        final = self.root / relative
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.with_name(f".{final.name}.tmp")
        pq.write_table(to_table(episodes), staging, compression="zstd")
        staging.rename(final)
        self.episodes_written += len(episodes)
        self.files_written += 1
        if self.uploader is not None:
            # The uploader keeps its own copy in its spool until the upload succeeds.
            self.uploader.submit(final, relative.as_posix())
            final.unlink(missing_ok=True)
        return final

    def close(self, upload_timeout_s: float = 60.0) -> list[Path]:
        """Writes what is buffered and waits for uploads; returns files still waiting in
        the upload spool (empty when everything arrived, or without an uploader)."""
        self.flush()
        if self.uploader is None:
            return []
        return self.uploader.close(upload_timeout_s)

    def stats(self) -> StoreStats:
        pending = self.uploader.pending() if self.uploader is not None else 0
        return StoreStats(self.episodes_written, self.files_written, len(self._buffer), pending)


def _file_stamp() -> str:
    # Sortable by time, unique across processes writing the same partition.
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


def mark_trained(episodes: list[Episode], trained_at: float | None) -> list[Episode]:
    """Returns the episodes with trained_at set (None: never trained on)."""
    for episode in episodes:
        episode.trained_at = trained_at if episode.reward is not None else None
    return episodes


def open_store(config: StoreConfig, run_dir: Path, run_id: str) -> EpisodeStore:
    """Returns the store a config names: a local directory (default <run_dir>/episodes),
    or files staged under the run directory and shipped to S3 or pre-signed URLs."""
    if config.presigned_url_service or config.path.startswith("s3://"):
        from rlray.s3 import make_uploader

        root = run_dir / "episode-staging"
        uploader = make_uploader(config, spool_dir=run_dir / "episode-spool")
    else:
        root, uploader = Path(config.path or run_dir / "episodes"), None
    return EpisodeStore(root, run_id, config.rows_per_file, config.flush_every_s, uploader)
