"""The episode-store uploaders against a real S3 HTTP server (moto) on 127.0.0.1.

Nothing here mocks boto3 or rlray: outages are the server really stopping, crashes are a
new uploader on an old spool. Backoffs are short so that the file runs in seconds.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from rlray.episodes.s3 import PresignedUploader, S3Uploader, parse_s3_uri, put_presigned

REPO = Path(__file__).resolve().parent.parent
FAST_RETRY = {"backoff_s": 0.05, "max_backoff_s": 0.2}
DRAIN_TIMEOUT_S = 30.0  # generous: close returns as soon as the queue drains


class S3Server:
    """A moto S3 server on a fixed 127.0.0.1 port that can go down and come back."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def aws_env(monkeypatch) -> None:
    """Fake credentials for the standard AWS chain, and no developer config or proxy."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server(aws_env) -> Iterator[S3Server]:
    s3_server = S3Server(free_port())
    s3_server.start()
    yield s3_server
    s3_server.stop()


@pytest.fixture
def bucket() -> str:
    # moto keeps its buckets in process-wide state, even across server restarts.
    return f"episodes-{uuid.uuid4().hex[:12]}"


def s3_client(endpoint_url: str):
    return boto3.client("s3", endpoint_url=endpoint_url)


def ensure_bucket(endpoint_url: str, bucket: str) -> None:
    client = s3_client(endpoint_url)
    if bucket not in {entry["Name"] for entry in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=bucket)


def bucket_objects(endpoint_url: str, bucket: str) -> dict[str, bytes]:
    """Returns every object in `bucket` as {key: bytes}."""
    client = s3_client(endpoint_url)
    listing = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {
        entry["Key"]: client.get_object(Bucket=bucket, Key=entry["Key"])["Body"].read()
        for entry in listing
    }


def episode_files(directory: Path, count: int, first: int = 0) -> dict[str, Path]:
    """Writes `count` distinct files; returns {key relative to the prefix: local path}."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for seq in range(first, first + count):
        path = directory / f"part-{seq:05d}.parquet"
        path.write_bytes(f"episode batch {seq}\n".encode() * (seq + 1))
        files[f"run=r1/date=2026-01-0{1 + seq % 2}/part-{seq:05d}.parquet"] = path
    return files


def submit_all(uploader, files: dict[str, Path]) -> dict[str, bytes]:
    """Submits `files` in order, deleting each local copy; returns {key: bytes}."""
    contents = {}
    for key, path in files.items():
        contents[key] = path.read_bytes()
        uploader.submit(path, key)
        path.unlink()  # the spool holds its own link
    return contents


def spooled_files(spool: Path) -> list[Path]:
    return sorted(spool.glob("*.data"))


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def with_prefix(prefix: str, contents: dict[str, bytes]) -> dict[str, bytes]:
    return {f"{prefix}/{key}": data for key, data in contents.items()}


def test_parse_s3_uri_splits_bucket_and_prefix():
    assert parse_s3_uri("s3://bucket/runs/episodes/") == ("bucket", "runs/episodes")
    assert parse_s3_uri("s3://bucket") == ("bucket", "")


@pytest.mark.parametrize("uri", ["bucket/prefix", "https://bucket/prefix", "s3:///prefix"])
def test_parse_s3_uri_rejects_other_uris_in_one_line(uri):
    with pytest.raises(ValueError) as error:
        parse_s3_uri(uri)
    assert "\n" not in str(error.value)


def test_submitted_files_arrive_with_their_keys_and_bytes(server, bucket, tmp_path):
    ensure_bucket(server.url, bucket)
    uploader = S3Uploader(bucket, "store/", tmp_path / "spool", server.url, **FAST_RETRY)
    contents = submit_all(uploader, episode_files(tmp_path / "local", 4))

    assert uploader.close(timeout_s=DRAIN_TIMEOUT_S) == []
    assert uploader.pending() == 0
    assert bucket_objects(server.url, bucket) == with_prefix("store", contents)
    assert spooled_files(tmp_path / "spool") == []
    assert list((tmp_path / "spool").glob("*.key")) == []


def test_files_wait_in_the_spool_while_s3_is_down_and_upload_in_order_after(
    server, bucket, tmp_path
):
    ensure_bucket(server.url, bucket)
    put_urls: list[str] = []
    failed_puts: list[Exception] = []

    def note_answer(http_response, **_) -> None:
        if http_response.status_code < 300:
            put_urls.append(http_response.url)

    def note_failure(exception, **_) -> None:
        failed_puts.append(exception)

    def recording_client():
        # botocore's own event hooks: a real client that notes each PutObject's outcome.
        client = s3_client(server.url)
        client.meta.events.register("after-call.s3.PutObject", note_answer)
        client.meta.events.register("after-call-error.s3.PutObject", note_failure)
        return client

    spool = tmp_path / "spool"
    uploader = S3Uploader(bucket, "p", spool, client_factory=recording_client, **FAST_RETRY)
    before = submit_all(uploader, episode_files(tmp_path / "local", 2))
    wait_until(lambda: uploader.pending() == 0)
    in_bucket_before_stop = bucket_objects(server.url, bucket)
    assert in_bucket_before_stop == with_prefix("p", before)

    server.stop()
    during = submit_all(uploader, episode_files(tmp_path / "local", 3, first=2))
    wait_until(lambda: len(failed_puts) >= 3)  # the uploader has tried, and failed, while down
    assert uploader.pending() == 3
    assert len(spooled_files(spool)) == 3

    server.start()
    ensure_bucket(server.url, bucket)  # in case the restarted server forgot it
    assert uploader.close(timeout_s=DRAIN_TIMEOUT_S) == []

    arrived = {**in_bucket_before_stop, **bucket_objects(server.url, bucket)}
    assert arrived == with_prefix("p", {**before, **during})
    uploaded_keys = [urllib.parse.unquote(urllib.parse.urlsplit(url).path) for url in put_urls]
    assert uploaded_keys == [f"/{bucket}/p/{key}" for key in [*before, *during]]
    assert spooled_files(spool) == []


def test_a_file_on_another_filesystem_is_copied_into_the_spool(server, bucket, tmp_path):
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip(reason="needs /dev/shm on a filesystem apart from tmp_path")
    ensure_bucket(server.url, bucket)
    local_dir = other / f"rlray-test-{uuid.uuid4().hex}"
    try:
        uploader = S3Uploader(bucket, "p", tmp_path / "spool", server.url, **FAST_RETRY)
        contents = submit_all(uploader, episode_files(local_dir, 2))
        assert uploader.close(timeout_s=DRAIN_TIMEOUT_S) == []
    finally:
        for path in local_dir.glob("*"):
            path.unlink()
        local_dir.rmdir()
    assert bucket_objects(server.url, bucket) == with_prefix("p", contents)


def test_close_returns_the_spool_when_s3_never_answers_and_a_new_uploader_resumes_it(
    aws_env, bucket, tmp_path, caplog
):
    down = S3Server(free_port())  # nothing listens on its port yet
    spool = tmp_path / "spool"
    uploader = S3Uploader(bucket, "p", spool, down.url, **FAST_RETRY)
    contents = submit_all(uploader, episode_files(tmp_path / "local", 3))

    with caplog.at_level(logging.WARNING, logger="rlray.episodes.s3"):
        leftovers = uploader.close(timeout_s=0.5)

    assert leftovers == spooled_files(spool)
    assert len(leftovers) == 3
    naming_spool = [record for record in caplog.records if str(spool) in record.getMessage()]
    assert len(naming_spool) == 1
    assert "3 episode files" in naming_spool[0].getMessage()

    down.start()
    try:
        ensure_bucket(down.url, bucket)
        resumed = S3Uploader(bucket, "p", spool, down.url, **FAST_RETRY)
        assert resumed.close(timeout_s=DRAIN_TIMEOUT_S) == []
        assert bucket_objects(down.url, bucket) == with_prefix("p", contents)
    finally:
        down.stop()


def test_the_command_in_the_leftover_warning_uploads_the_spool(aws_env, bucket, tmp_path, caplog):
    down = S3Server(free_port())
    spool = tmp_path / "spool"
    uploader = S3Uploader(bucket, "runs/r1", spool, down.url, **FAST_RETRY)
    contents = submit_all(uploader, episode_files(tmp_path / "local", 2))
    with caplog.at_level(logging.WARNING, logger="rlray.episodes.s3"):
        assert len(uploader.close(timeout_s=0.2)) == 2
    command = re.search(r"`python (-m rlray\.episodes\.s3 upload-spool [^`]+)`", caplog.text)
    assert command is not None, caplog.text

    down.start()
    try:
        ensure_bucket(down.url, bucket)
        result = subprocess.run(
            [sys.executable, *command[1].split()],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "uploaded 2 of 2 files" in result.stdout
        assert bucket_objects(down.url, bucket) == with_prefix("runs/r1", contents)
        assert spooled_files(spool) == []
    finally:
        down.stop()


def test_a_crash_mid_submit_leaves_nothing_half_spooled(aws_env, bucket, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "000000000007.key").write_text("key whose data never arrived")
    (spool / "000000000008.key.tmp").write_text("half-written key")

    uploader = S3Uploader(bucket, "p", spool, S3Server(free_port()).url, **FAST_RETRY)

    assert uploader.pending() == 0
    assert uploader.close(timeout_s=1.0) == []
    assert sorted(path.name for path in spool.iterdir()) == [".lock"]


def test_one_spool_has_one_uploader_at_a_time(aws_env, bucket, tmp_path):
    url = S3Server(free_port()).url
    first = S3Uploader(bucket, "p", tmp_path / "spool", url, **FAST_RETRY)
    with pytest.raises(RuntimeError, match="in use"):
        S3Uploader(bucket, "p", tmp_path / "spool", url, **FAST_RETRY)
    first.close(timeout_s=1.0)
    S3Uploader(bucket, "p", tmp_path / "spool", url, **FAST_RETRY).close(timeout_s=1.0)


def presigned_put_url(endpoint_url: str, bucket: str, key: str) -> str:
    return s3_client(endpoint_url).generate_presigned_url(
        "put_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=300
    )


def test_put_presigned_uploads_to_a_presigned_url(server, bucket, tmp_path):
    ensure_bucket(server.url, bucket)
    local_file = tmp_path / "part-00000.parquet"
    local_file.write_bytes(b"\x00parquet bytes\xff" * 1000)

    put_presigned(local_file, presigned_put_url(server.url, bucket, "a/part-00000.parquet"))

    assert bucket_objects(server.url, bucket) == {"a/part-00000.parquet": local_file.read_bytes()}


def test_put_presigned_raises_one_line_error_without_the_signature(aws_env, tmp_path):
    local_file = tmp_path / "part.parquet"
    local_file.write_bytes(b"x")
    url = f"http://127.0.0.1:{free_port()}/bucket/key?X-Amz-Signature=secret"

    with pytest.raises(RuntimeError) as error:
        put_presigned(local_file, url, timeout_s=2, attempts=2, backoff_s=0.01)

    message = str(error.value)
    assert "after 2 attempts" in message
    assert "\n" not in message
    assert "secret" not in message


def test_presigned_uploader_uploads_every_file_through_url_for(server, bucket, tmp_path):
    ensure_bucket(server.url, bucket)
    asked_for: list[str] = []

    def url_for(key: str) -> str:
        asked_for.append(key)
        return presigned_put_url(server.url, bucket, f"signed/{key}")

    uploader = PresignedUploader(url_for, tmp_path / "spool", **FAST_RETRY)
    contents = submit_all(uploader, episode_files(tmp_path / "local", 3))

    assert uploader.close(timeout_s=DRAIN_TIMEOUT_S) == []
    assert asked_for == list(contents)
    assert bucket_objects(server.url, bucket) == with_prefix("signed", contents)
