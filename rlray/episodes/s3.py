"""Ships finished episode files to S3 (or to pre-signed URLs) off the training path, never
losing one.

`submit(file, key)` hard-links the file into a spool directory and returns; one background
thread uploads the spooled files in submission order and deletes each from the spool only
after its upload succeeded. Files stay in the spool while the destination is unreachable, and
across crashes: a new uploader on the same spool queues them again.

Spool layout: each file is two entries named by a 12-digit submission number,
`<seq>.data` (the bytes, hard-linked or copied in) and `<seq>.key` (the object key, UTF-8,
relative to the uploader's prefix). A sidecar rather than a key encoded in the file name
because S3 keys may be up to 1024 bytes and file names only 255. `.key` is written before
`.data` and removed after it, so a crash at any point leaves either a complete entry or a
lone `.key`, which the next uploader drops (its submit never returned). Upload is at least
once: a crash between a successful upload and the spool delete uploads that file again, to
the same key with the same bytes. One uploader holds a spool at a time (an flock on
`<spool>/.lock`), so two processes never hand out the same submission number.

Success means the PUT returned 2xx: S3 answers a PutObject only once the object is stored,
and botocore sends a checksum of the body that S3 verifies, so no HEAD follows it.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import http.client
import logging
import os
import re
import shlex
import shutil
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import boto3
from botocore.config import Config

from rlray.config import StoreConfig

logger = logging.getLogger(__name__)

_SPOOL_NAME = re.compile(r"(\d+)\.(key|data)(\.tmp)?")
_MAX_BACKOFF_DOUBLINGS = 30  # 2**30 times any sane backoff_s is past any cap; keeps floats finite


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Returns (bucket, key prefix) of "s3://bucket/prefix"; the prefix has no outer slashes."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an S3 URI (expected s3://bucket/prefix): {uri!r}")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ValueError(f"S3 URI names no bucket (expected s3://bucket/prefix): {uri!r}")
    return bucket, prefix.strip("/")


def put_presigned(
    local_file: Path,
    url: str,
    timeout_s: float = 30,
    attempts: int = 5,
    backoff_s: float = 0.5,
) -> None:
    """Uploads `local_file` with HTTP PUT to a pre-signed `url`, retrying with exponential
    backoff; returns once the server answered 2xx, raises RuntimeError after `attempts`.

    The request carries Content-Type application/octet-stream, so the URL must not sign
    another content type."""
    last_error: Exception | None = None
    for attempt in range(1, attempts + 1):
        try:
            _put_once(Path(local_file), url, timeout_s)
            return
        # URLError, HTTPError, timeouts and resets are OSErrors; a garbled reply is not.
        except (OSError, http.client.HTTPException) as error:
            last_error = error
            if attempt < attempts:
                time.sleep(_backoff_delay(attempt, backoff_s, max_backoff_s=30.0))
    raise RuntimeError(
        f"PUT of {local_file} to {_without_query(url)} failed after {attempts} attempts: "
        f"{_one_line(last_error)}"
    )


def _put_once(local_file: Path, url: str, timeout_s: float) -> None:
    size = local_file.stat().st_size
    with local_file.open("rb") as body:
        # An explicit length streams the file; without it urllib would send it chunked,
        # which S3 refuses for pre-signed PUTs.
        headers = {"Content-Length": str(size), "Content-Type": "application/octet-stream"}
        request = urllib.request.Request(url, data=body, headers=headers, method="PUT")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()


def _without_query(url: str) -> str:
    """The URL without its query string: a pre-signed URL's signature stays out of logs."""
    return urllib.parse.urlsplit(url)._replace(query="", fragment="").geturl()


def _one_line(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _backoff_delay(failures: int, backoff_s: float, max_backoff_s: float) -> float:
    """Seconds to wait after the `failures`-th consecutive failure: doubling, capped."""
    return min(backoff_s * 2 ** min(failures - 1, _MAX_BACKOFF_DOUBLINGS), max_backoff_s)


@dataclass(frozen=True)
class SpoolEntry:
    """One file waiting in the spool: `<seq>.data` holds its bytes, `<seq>.key` its key."""

    seq: int
    key: str
    data_path: Path

    @property
    def key_path(self) -> Path:
        return self.data_path.with_suffix(".key")


class Spool:
    """The on-disk queue of files waiting for upload (layout in the module docstring). Not
    thread-safe: its uploader calls it under its own lock."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file: IO[str] | None = _lock_exclusively(self.directory)
        self._next_seq = 0

    def recover(self) -> list[SpoolEntry]:
        """Returns the complete entries an earlier uploader left, oldest first; deletes the
        half-written ones (temporary files, keys whose data never arrived)."""
        keys: dict[int, Path] = {}
        data: dict[int, Path] = {}
        for path in self.directory.iterdir():
            match = _SPOOL_NAME.fullmatch(path.name)
            if match is None:
                continue  # the lock file, or something a person put there
            seq = int(match[1])
            self._next_seq = max(self._next_seq, seq + 1)
            if match[3]:
                path.unlink()
            elif match[2] == "key":
                keys[seq] = path
            else:
                data[seq] = path
        for seq in sorted(keys.keys() - data.keys()):
            keys[seq].unlink()
        for seq in sorted(data.keys() - keys.keys()):
            logger.warning("%s has no .key file; left in place, not uploaded", data[seq])
        return [self._entry(seq, keys[seq]) for seq in sorted(keys.keys() & data.keys())]

    def _entry(self, seq: int, key_path: Path) -> SpoolEntry:
        return SpoolEntry(seq, key_path.read_bytes().decode("utf-8"), key_path.with_suffix(".data"))

    def add(self, local_file: Path, key: str) -> SpoolEntry:
        """Returns a new entry for `local_file` once its key and bytes are durably spooled."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        entry = SpoolEntry(seq, key, self.directory / f"{seq:012d}.data")
        _write_durably(entry.key_path, key.encode("utf-8"))
        try:
            _link_or_copy(local_file, entry.data_path)
        except BaseException:
            entry.key_path.unlink(missing_ok=True)
            raise
        _fsync(self.directory)
        return entry

    def remove(self, entry: SpoolEntry) -> None:
        """Deletes an uploaded entry, data first (a lone .key is dropped on recovery)."""
        entry.data_path.unlink(missing_ok=True)
        entry.key_path.unlink(missing_ok=True)

    def release(self) -> None:
        """Lets another uploader take the spool."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


def _lock_exclusively(directory: Path) -> IO[str]:
    lock_file = (directory / ".lock").open("a")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        raise RuntimeError(f"spool {directory} is in use by another uploader") from None
    return lock_file


def _write_durably(path: Path, content: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(content)
    _fsync(temporary)
    os.replace(temporary, path)


def _link_or_copy(source: Path, target: Path) -> None:
    """Puts `source`'s bytes at `target` by hard link, or by copy and atomic rename where
    links fail (another filesystem, or one without hard links)."""
    try:
        os.link(source, target)
    except OSError:
        temporary = target.with_name(target.name + ".tmp")
        shutil.copyfile(source, temporary)
        _fsync(temporary)
        os.replace(temporary, target)
    else:
        _fsync(target)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class SpooledUploader:
    """Uploads submitted files from one background thread in submission order; each waits
    in the spool until its upload succeeds. Subclasses supply the transport, `_put`.

    Any exception from `_put` is retried after an exponential backoff (backoff_s doubling
    up to max_backoff_s) for as long as the uploader runs: a failing file holds back the
    ones behind it, which keeps the order. Every `max_attempts_per_round` consecutive
    failures the transport is rebuilt (fresh connections and credentials) and a warning
    is logged."""

    destination = "upload destination"  # how log lines name where files go

    def __init__(
        self, spool_dir: Path, max_attempts_per_round: int, backoff_s: float, max_backoff_s: float
    ):
        self.max_attempts_per_round = max_attempts_per_round
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.spool = Spool(spool_dir)
        self._entries: deque[SpoolEntry] = deque(self.spool.recover())
        if self._entries:
            logger.info("queued %d files an earlier run left in %s", len(self._entries), spool_dir)
        self._changed = threading.Condition()
        self._closing = False
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()

    def submit(self, local_file: Path, key: str) -> None:
        """Spools `local_file` under `key` and returns before its upload. The caller may then
        delete its copy, but must not rewrite it in place: a hard link shares the bytes."""
        with self._changed:
            if self._closing:
                raise RuntimeError(f"submit of {key} after close")
            self._entries.append(self.spool.add(Path(local_file), key))
            self._changed.notify_all()

    def pending(self) -> int:
        """Returns how many submitted or recovered files are not uploaded yet."""
        with self._changed:
            return len(self._entries)

    def close(self, timeout_s: float) -> list[Path]:
        """Returns the files still in the spool after waiting at most `timeout_s` for the
        queue to drain (empty: all uploaded); logs one warning when some are left."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join(timeout_s)
        with self._changed:
            # An upload in flight may still finish; the daemon thread then exits.
            self._abort.set()
            self._changed.notify_all()
            leftovers = [entry.data_path for entry in self._entries]
        self.spool.release()
        if leftovers:
            logger.warning(
                "%s unreachable: %d episode files wait in %s; they upload on the next run "
                "with the same spool%s",
                self.destination,
                len(leftovers),
                self.spool.directory,
                self._resume_hint(),
            )
        return leftovers

    def _put(self, local_file: Path, key: str) -> None:
        """Uploads one file; raises on any failure. Runs only in the upload thread."""
        raise NotImplementedError

    def _reset_transport(self) -> None:
        """Drops connection state after a round of failures; the next `_put` rebuilds it."""

    def _resume_hint(self) -> str:
        """Returns how else the spool can be uploaded, for the leftover warning."""
        return ""

    def _run(self) -> None:
        while (entry := self._next_entry()) is not None:
            if self._upload_until_done(entry):
                with self._changed:
                    self.spool.remove(entry)
                    self._entries.popleft()
                    self._changed.notify_all()

    def _next_entry(self) -> SpoolEntry | None:
        """Returns the oldest waiting entry, or None once closed and drained, or aborted."""
        with self._changed:
            while not (self._entries or self._closing or self._abort.is_set()):
                self._changed.wait()
            if self._abort.is_set() or not self._entries:
                return None
            return self._entries[0]

    def _upload_until_done(self, entry: SpoolEntry) -> bool:
        """Returns True once `entry` is uploaded (or gone), False if close gave up on it."""
        failures = 0
        while not self._abort.is_set():
            try:
                self._put(entry.data_path, entry.key)
                return True
            except Exception as error:
                if not entry.data_path.exists():
                    # An earlier uploader's thread, still finishing after its close, did it.
                    logger.info("spool file %s for %s is gone; skipping", entry.seq, entry.key)
                    return True
                failures += 1
                self._note_failure(entry, error, failures)
                self._abort.wait(_backoff_delay(failures, self.backoff_s, self.max_backoff_s))
        return False

    def _note_failure(self, entry: SpoolEntry, error: Exception, failures: int) -> None:
        if failures % self.max_attempts_per_round:
            logger.debug("upload of %s failed (%s); retrying", entry.key, _one_line(error))
            return
        logger.warning(
            "%s: upload of %s failed %d times in a row (%s); %d files wait; retrying",
            self.destination,
            entry.key,
            failures,
            _one_line(error),
            self.pending(),
        )
        self._reset_transport()


class S3Uploader(SpooledUploader):
    """Uploads files to s3://bucket/prefix/<key> with credentials from the standard AWS chain.

    `client_factory` (called in the upload thread, since clients are not shared across
    threads) overrides the default client, whose own retries are off so that only this
    class's backoff applies. Objects go up in one PutObject each (at most 5 GB)."""

    destination = "S3"

    def __init__(
        self,
        bucket: str,
        prefix: str,
        spool_dir: Path,
        endpoint_url: str | None = None,
        max_attempts_per_round: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        client_factory: Callable[[], Any] | None = None,
    ):
        # Set before the base class starts the upload thread, which reads them.
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self._client_factory = client_factory or functools.partial(_s3_client, endpoint_url)
        self._client: Any = None
        super().__init__(spool_dir, max_attempts_per_round, backoff_s, max_backoff_s)

    def object_key(self, key: str) -> str:
        """Returns the full S3 key a file submitted under `key` is stored at."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _put(self, local_file: Path, key: str) -> None:
        if self._client is None:
            self._client = self._client_factory()
        with local_file.open("rb") as body:
            self._client.put_object(Bucket=self.bucket, Key=self.object_key(key), Body=body)

    def _reset_transport(self) -> None:
        self._client = None

    def _resume_hint(self) -> str:
        endpoint = f" --endpoint-url {self.endpoint_url}" if self.endpoint_url else ""
        uri = f"s3://{self.bucket}/{self.prefix}"
        spool = shlex.quote(str(self.spool.directory))
        return f" or with `python -m rlray.episodes.s3 upload-spool {spool} {uri}{endpoint}`"


def _s3_client(endpoint_url: str | None) -> Any:
    config = Config(connect_timeout=10, read_timeout=60, retries={"total_max_attempts": 1})
    return boto3.client("s3", endpoint_url=endpoint_url, config=config)


class PresignedUploader(SpooledUploader):
    """Uploads each file with HTTP PUT to the pre-signed URL `url_for(key)` returns, for users
    without AWS credentials whose own service signs URLs. `url_for` is called again on every
    attempt, so an expired URL is replaced by the retry."""

    destination = "pre-signed upload"

    def __init__(
        self,
        url_for: Callable[[str], str],
        spool_dir: Path,
        max_attempts_per_round: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        timeout_s: float = 30.0,
    ):
        self.url_for = url_for
        self.timeout_s = timeout_s
        super().__init__(spool_dir, max_attempts_per_round, backoff_s, max_backoff_s)

    def _put(self, local_file: Path, key: str) -> None:
        # One attempt: the queue's retry loop owns the backoff.
        put_presigned(local_file, self.url_for(key), timeout_s=self.timeout_s, attempts=1)


def url_from_service(service_url: str, timeout_s: float = 30.0) -> Callable[[str], str]:
    """Returns url_for(key): a GET of `<service_url>?key=<key>` whose body is the pre-signed
    PUT URL for that key (the user's own signing service)."""

    def url_for(key: str) -> str:
        separator = "&" if "?" in service_url else "?"
        query = urllib.parse.urlencode({"key": key})
        with urllib.request.urlopen(f"{service_url}{separator}{query}", timeout=timeout_s) as r:
            return r.read().decode().strip()

    return url_for


def make_uploader(config: StoreConfig, spool_dir: Path) -> SpooledUploader:
    """Returns the uploader an episode-store config asks for: pre-signed URLs from
    `presigned_url_service` when set, else S3 at `path` (s3://bucket/prefix)."""
    if config.presigned_url_service:
        return PresignedUploader(url_from_service(config.presigned_url_service), spool_dir)
    bucket, prefix = parse_s3_uri(config.path)
    return S3Uploader(bucket, prefix, spool_dir, endpoint_url=config.s3_endpoint_url or None)


def upload_spool(
    spool_dir: Path, s3_uri: str, endpoint_url: str | None = None, timeout_s: float = 600.0
) -> list[Path]:
    """Uploads the files a run left in `spool_dir` to `s3_uri`; returns those still left."""
    if not Path(spool_dir).is_dir():
        raise FileNotFoundError(f"no spool directory at {spool_dir}")
    bucket, prefix = parse_s3_uri(s3_uri)
    uploader = S3Uploader(bucket, prefix, spool_dir, endpoint_url=endpoint_url)
    waiting = uploader.pending()
    leftovers = uploader.close(timeout_s)
    print(f"uploaded {waiting - len(leftovers)} of {waiting} files from {spool_dir} to {s3_uri}")
    return leftovers


def main(argv: list[str] | None = None) -> int:
    """`python -m rlray.episodes.s3 upload-spool SPOOL S3_URI`: exits 0 once the spool is empty."""
    parser = argparse.ArgumentParser(
        prog="python -m rlray.episodes.s3",
        description="Upload episode files a run left in its spool.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    upload = commands.add_parser("upload-spool", help="upload the files a run left in its spool")
    upload.add_argument("spool", type=Path, help="the spool directory the run's warning named")
    upload.add_argument("s3_uri", help="s3://bucket/prefix the run uploaded to")
    upload.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint, if not AWS")
    upload.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="give up after this many seconds; files not uploaded stay in the spool",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        leftovers = upload_spool(args.spool, args.s3_uri, args.endpoint_url, args.timeout_s)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        parser.error(str(error))
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
