"""EpisodeStore: every episode of a run, appended to Parquet files in batches.

Files are partitioned by each episode's run and the date,
`<root>/run=<run_id>/date=<YYYY-MM-DD>/part-*.parquet` (hive style, run ids URI-encoded,
so pyarrow.dataset reads them back with those two columns). Rows are buffered and written
once `rows_per_file` have gathered (or `flush_every_s` has passed), never a file per
episode; each file is written under a temporary name and renamed, so a reader never sees
half a file. With an S3 (or pre-signed URL) sink the finished files go to the uploader,
which ships them off the training path and keeps them in a local spool until they are
uploaded.

With a journal (the `store` actor always has one) an append is on disk before it returns:
if the store's process dies, the restarted store finds the appended rows not yet in a file
and writes them, under the same file names a finished write would have used, so a write
cut short is redone, not doubled. Appends carry a key; an append retried after the store
died (its first answer lost) is recognised by the key and stored once.

A plain class: tests use it in-process; rlray.cluster runs it as the `store` actor.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlray.config import StoreConfig
from rlray.core.episode import EPISODE_SCHEMA, Episode, to_table, validate_episodes
from rlray.core.files import writing
from rlray.core.stats import StoreStats


class Uploader(Protocol):
    def submit(self, local_file: Path, key: str) -> None: ...
    def close(self, timeout_s: float) -> list[Path]: ...
    def pending(self) -> int: ...


class Journal:
    """The appends a store has not yet written to files, on disk, one Arrow IPC file each:
    `<seq>-<key>.arrow` (written under a temporary name, then renamed). `written` lists
    "<seq> <key>" of appends already written to files; `id` names the journal in the
    files its store writes. Survives the death of the process, not of the machine (no
    fsync)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        id_file = self.directory / "id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12])
        self.id = id_file.read_text().strip()
        self._written = self.directory / "written"
        lines = self._written.read_text().split("\n") if self._written.exists() else []
        seqs_keys = [line.split(" ") for line in lines if line.count(" ") == 1]
        self.pending = sorted(self.directory.glob("*.arrow"))
        seqs_keys += [list(_JOURNAL_NAME.fullmatch(p.name).groups()) for p in self.pending]
        self.keys = {key for _, key in seqs_keys}
        self._next_seq = max((int(seq) for seq, _ in seqs_keys), default=-1) + 1
        for path in self.directory.glob("*.tmp"):
            path.unlink()  # an append cut short: it never returned, its caller retries

    def recover(self) -> list[pa.Table]:
        """Returns the episodes of every pending append, a table each, in append order."""
        return [_read_ipc(path).select(EPISODE_SCHEMA.names) for path in self.pending]

    def record(self, key: str, table: pa.Table) -> None:
        """Writes one append (its episodes as a table, EPISODE_SCHEMA); after it returns
        they survive this process."""
        if not re.fullmatch(r"[\w.-]{1,100}", key):
            raise ValueError(f"store append key must be 1-100 word characters, got {key!r}")
        final = self.directory / f"{self._next_seq:012d}-{key}.arrow"
        staging = final.with_name(final.name + ".tmp")
        with (
            writing(staging),
            pa.OSFile(str(staging), "wb") as sink,
            pa.ipc.new_file(sink, table.schema) as out,
        ):
            out.write_table(table)
        os.replace(staging, final)
        self._next_seq += 1
        self.pending.append(final)
        self.keys.add(key)

    def first_pending_seq(self) -> int:
        return int(self.pending[0].name.split("-")[0])

    def written(self) -> None:
        """Marks every pending append as written to files: listed first, then deleted."""
        seqs_keys = [_JOURNAL_NAME.fullmatch(path.name).groups() for path in self.pending]
        with writing(self._written), self._written.open("a") as out:
            out.write("".join(f"{seq} {key}\n" for seq, key in seqs_keys))
        for path in self.pending:
            path.unlink()
        self.pending = []


_JOURNAL_NAME = re.compile(r"(\d{12})-([\w.-]+)\.arrow")


def _read_ipc(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


class EpisodeStore:
    """Buffers episodes and writes them as Parquet files under `root`."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        rows_per_file: int = 2048,
        flush_every_s: float = 60.0,
        uploader: Uploader | None = None,
        journal_dir: Path | None = None,
    ):
        self.root = Path(root)
        self.run_id = run_id
        self.rows_per_file = rows_per_file
        self.flush_every_s = flush_every_s
        self.uploader = uploader
        self.journal = Journal(journal_dir) if journal_dir is not None else None
        self._tables: list[pa.Table] = self.journal.recover() if self.journal else []
        """The episodes appended and not yet written, a table an append: converted to
        Arrow once, for the journal and the files both."""
        self._rows = sum(table.num_rows for table in self._tables)
        self.recovered = self._rows
        """Episodes an earlier process of this store appended but had not written."""
        self._last_flush = time.monotonic()
        self.episodes_written = 0
        self.files_written = 0

    def append(self, episodes: list[Episode], key: str | None = None) -> int:
        """Buffers the episodes (journaled under `key` if the store has a journal); writes
        files once enough rows or time have gathered. Returns how many episodes were
        added: 0 for a key appended before."""
        validate_episodes(episodes, where="store append")  # before anything is written
        if self.journal is not None:
            key = key or uuid.uuid4().hex
            if key in self.journal.keys:
                return 0
        table = to_table(episodes)
        if self.journal is not None:
            self.journal.record(key, table)
        self._tables.append(table)
        self._rows += table.num_rows
        if self._rows >= self.rows_per_file or self._flush_due():
            self.flush()
        return len(episodes)

    def _flush_due(self) -> bool:
        return time.monotonic() - self._last_flush >= self.flush_every_s

    def flush(self) -> list[Path]:
        """Writes every buffered episode now; returns the files written."""
        if not self._rows:
            self._last_flush = time.monotonic()
            return []
        written = []
        # With a journal, names depend only on what is written, so redoing a flush that
        # a dead process started replaces its files instead of adding copies.
        journal = self.journal
        stamp = f"{journal.id}-{journal.first_pending_seq():012d}" if journal else _file_stamp()
        table = pa.concat_tables(self._tables)
        for chunk_index, start in enumerate(range(0, table.num_rows, self.rows_per_file)):
            chunk = table.slice(start, self.rows_per_file)
            for run_id, rows in _by_run(chunk).items():
                written.append(self._write_file(run_id, rows, f"{stamp}-{chunk_index:04d}"))
        self._tables, self._rows = [], 0
        if self.journal is not None and self.journal.pending:
            self.journal.written()
        self._last_flush = time.monotonic()
        return written

    def _write_file(self, run_id: str, rows: pa.Table, name: str) -> Path:
        date = datetime.now(UTC).strftime("%Y-%m-%d")
        run = quote(run_id, safe="")
        relative = Path(f"run={run}", f"date={date}", f"part-{name}.parquet")
        final = self.root / relative
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.with_name(f".{final.name}.tmp")
        with writing(staging):
            pq.write_table(rows, staging, compression="zstd")
        staging.rename(final)
        self.episodes_written += rows.num_rows
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
        return StoreStats(self.episodes_written, self.files_written, self._rows, pending)


def _by_run(table: pa.Table) -> dict[str, pa.Table]:
    """Splits episodes by their own run id (posted episodes keep theirs), each run's in
    order."""
    runs = table.column("run_id")
    unique = pc.unique(runs).to_pylist()
    if len(unique) == 1:
        return {unique[0]: table}
    return {run_id: table.filter(pc.equal(runs, run_id)) for run_id in unique}


def _file_stamp() -> str:
    # Sortable by time, unique across processes writing the same partition.
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


def mark_trained(episodes: list[Episode], trained_at: float | None) -> list[Episode]:
    """Returns the episodes with trained_at set (None: never trained on)."""
    for episode in episodes:
        episode.trained_at = trained_at if episode.reward is not None else None
    return episodes


def open_store(config: StoreConfig, run_dir: Path, run_id: str, shard: int = 0) -> EpisodeStore:
    """Returns the store a config names: a local directory (default <run_dir>/episodes),
    or files staged under the run directory and shipped to S3 or pre-signed URLs. A
    shard's journal and spool are its own (shard 0's keep the unsharded names); its files
    are named by its journal's id, so shards never write the same file."""
    suffix = f"-{shard}" if shard else ""
    if config.presigned_url_service or config.path.startswith("s3://"):
        # boto3 loads only where episodes go to S3
        from rlray.episodes.s3 import make_uploader

        root = run_dir / "episode-staging"
        uploader = make_uploader(config, spool_dir=run_dir / f"episode-spool{suffix}")
    else:
        root, uploader = Path(config.path or run_dir / "episodes"), None
    return EpisodeStore(
        root,
        run_id,
        config.rows_per_file,
        config.flush_every_s,
        uploader,
        journal_dir=run_dir / journal_name(shard),
    )


def journal_name(shard: int) -> str:
    """The directory, in the run directory, of a store shard's journal."""
    return f"episode-journal-{shard}" if shard else "episode-journal"
