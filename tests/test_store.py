"""EpisodeStore writes batched, partitioned Parquet that rlray.episodes reads back; a
write that fails names its file."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlray.config import StoreConfig
from rlray.core.episode import to_table
from rlray.core.stats import StoreStats
from rlray.episodes.reader import read, summarize
from rlray.episodes.store import EpisodeStore, Journal, mark_trained, open_store
from rlray.observe.metrics_log import MetricsLog
from tests.jobs_helper import REPO
from tests.test_episode import make_episode


def episodes(count: int, start: int = 0, **fields):
    return [make_episode(episode_id=f"run-{start + i}", **fields) for i in range(count)]


def test_rows_are_written_in_batches_partitioned_by_run_and_date(tmp_path):
    store = EpisodeStore(tmp_path, "run", rows_per_file=4, flush_every_s=3600)
    store.append(episodes(3))
    assert not list(tmp_path.rglob("*.parquet"))  # below a file's worth: still buffered
    store.append(episodes(3, start=3))
    files = sorted(tmp_path.rglob("*.parquet"))
    assert [pq.read_metadata(f).num_rows for f in files] == [4, 2]  # rows_per_file at most
    assert files[0].parent.parent.name == "run=run" and files[0].parent.name.startswith("date=")
    assert store.close() == []
    assert sorted(read(tmp_path).column("episode_id").to_pylist()) == sorted(
        f"run-{i}" for i in range(6)
    )


def test_read_round_trips_every_field_and_filters_runs(tmp_path):
    first, second = EpisodeStore(tmp_path, "a"), EpisodeStore(tmp_path, "b")
    stored = episodes(2, run_id="a")
    first.append(stored)
    second.append(episodes(1, run_id="b"))
    first.close(), second.close()
    from rlray.core.episode import from_table

    back = from_table(read(tmp_path, runs=["a"]))
    for one, sent in zip(back, stored, strict=True):  # float32 logprobs: rounded
        assert one.rollout_logprobs == pytest.approx(sent.rollout_logprobs, rel=2**-24, abs=0)
        one.rollout_logprobs = sent.rollout_logprobs
    assert back == stored
    assert read(tmp_path).num_rows == 3


def stored_ids(root) -> list[str]:
    return sorted(read(root).column("episode_id").to_pylist())


def test_journal_keeps_appends_a_dead_store_had_not_written(tmp_path):
    journal = tmp_path / "journal"
    store = EpisodeStore(tmp_path / "episodes", "run", rows_per_file=100, journal_dir=journal)
    assert store.append(episodes(3), key="a") == 3
    assert not list(tmp_path.rglob("*.parquet"))  # buffered only, in memory and journal
    del store  # the process died: no close, no flush
    again = EpisodeStore(tmp_path / "episodes", "run", rows_per_file=100, journal_dir=journal)
    assert again.recovered == 3
    assert again.append(episodes(3), key="a") == 0  # the dead store's append, retried
    again.append(episodes(2, start=3), key="b")
    again.close()
    assert stored_ids(tmp_path / "episodes") == [f"run-{i}" for i in range(5)]
    # Keys of written appends are remembered too: a retry after a flush adds nothing.
    third = EpisodeStore(tmp_path / "episodes", "run", rows_per_file=100, journal_dir=journal)
    assert third.recovered == 0 and third.append(episodes(2, start=3), key="b") == 0
    third.append(episodes(1, start=5), key="c")  # a new file, next to the earlier ones
    third.close()
    assert stored_ids(tmp_path / "episodes") == [f"run-{i}" for i in range(6)]


def test_a_flush_cut_short_is_redone_without_copies(tmp_path, monkeypatch):
    from rlray.episodes import store as store_module

    journal = tmp_path / "journal"
    store = EpisodeStore(tmp_path / "episodes", "run", rows_per_file=2, journal_dir=journal)
    store.append(episodes(3), key="a")  # over rows_per_file: written as 2 + 1 rows
    store.append(episodes(1, start=3), key="b")  # buffered

    def die(self):  # the process dies after the files, before the journal is cleared
        raise SystemExit

    monkeypatch.setattr(store_module.Journal, "written", die)
    with pytest.raises(SystemExit):
        store.append(episodes(1, start=4), key="c")  # 2 rows: a file, then death
    monkeypatch.undo()
    first_files = sorted(p.name for p in (tmp_path / "episodes").rglob("*.parquet"))
    again = EpisodeStore(tmp_path / "episodes", "run", rows_per_file=2, journal_dir=journal)
    assert again.recovered == 2
    again.close()
    assert sorted(p.name for p in (tmp_path / "episodes").rglob("*.parquet")) == first_files
    assert stored_ids(tmp_path / "episodes") == [f"run-{i}" for i in range(5)]


def test_shards_keep_journals_of_their_own_and_never_write_the_same_file(tmp_path):
    config = StoreConfig(rows_per_file=4, flush_every_s=3600)
    shards = [open_store(config, tmp_path, "run", shard) for shard in range(2)]
    journals = sorted(p.name for p in tmp_path.glob("episode-journal*"))
    assert journals == ["episode-journal", "episode-journal-1"]
    for shard, store in enumerate(shards):  # the same key, the first append of each
        store.append(episodes(3, start=3 * shard), key="a")
    del shards, store  # both died before writing a file
    again = [open_store(config, tmp_path, "run", shard) for shard in range(2)]
    assert [store.recovered for store in again] == [3, 3]
    for store in again:
        store.close()
    assert stored_ids(tmp_path / "episodes") == [f"run-{i}" for i in range(6)]
    assert len(list((tmp_path / "episodes").rglob("*.parquet"))) == 2
    assert StoreStats.total([store.stats() for store in again]) == StoreStats(6, 2, 0, 0)


def test_episodes_are_filed_under_their_own_run_id(tmp_path):
    store = EpisodeStore(tmp_path, "job-run")
    store.append([make_episode(episode_id="x", run_id="posted/../run 1")])
    store.append([make_episode(episode_id="y", run_id="job-run")])
    store.close()
    runs = sorted(p.parent.parent.name for p in tmp_path.rglob("*.parquet"))
    assert runs == ["run=job-run", "run=posted%2F..%2Frun%201"]  # no path escapes the root
    assert read(tmp_path, runs=["posted/../run 1"]).column("episode_id").to_pylist() == ["x"]


def test_missing_store_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such episode store"):
        read(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no episode files"):
        read(tmp_path)


def test_mark_trained_leaves_dropped_episodes_untrained():
    kept, dropped = make_episode(), make_episode(reward=None)
    mark_trained([kept, dropped], 1700000000.0)
    assert kept.trained_at == 1700000000.0 and dropped.trained_at is None


def test_summary_and_the_episodes_tool(tmp_path):
    store = EpisodeStore(tmp_path, "run")
    scored = {"reward_components": {"exact_match": 1.0}}
    store.append(episodes(2, policy_version=0, reward=1.0, **scored))
    store.append(
        episodes(2, start=2, policy_version=1, reward=0.0, finish_reason="length", **scored)
    )
    store.append(
        episodes(1, start=4, policy_version=1, reward=None, reward_components={"exact_match": None})
    )
    store.close()
    summary = summarize(read(tmp_path))
    assert summary["episodes"] == 5
    assert summary["reward_mean_by_policy_version"] == {0: 1.0, 1: 0.0}
    assert summary["finish_reasons"] == {"length": 2, "stop": 3}
    assert summary["reward_failures"] == {"exact_match": 1}
    tool = [sys.executable, str(REPO / "jobs" / "episodes.py"), str(tmp_path)]
    out = subprocess.run([*tool, "--json"], capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout)["episodes"] == 5
    text = subprocess.run(tool, capture_output=True, text=True, timeout=120).stdout
    assert "5 episodes from 1 run(s): run" in text and "reward failures: exact_match 1" in text
    missing = subprocess.run([*tool[:2], str(tmp_path / "x")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.startswith("episodes.py: error: ")


def test_presigned_url_service_uploads_without_credentials(tmp_path, monkeypatch):
    """A store configured with only a signing service's URL: files reach the bucket."""
    import http.server
    import threading
    import urllib.parse

    import boto3
    from moto.server import ThreadedMotoServer

    from rlray.config import StoreConfig
    from rlray.episodes.store import open_store
    from tests.conftest import AWS_TEST_CREDENTIALS, free_port

    for key, value in AWS_TEST_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    s3_port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port)
    server.start()
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{s3_port}")
    s3.create_bucket(Bucket="signed")

    class Signer(http.server.BaseHTTPRequestHandler):  # the user's own signing service
        def do_GET(self):
            key = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["key"][0]
            params = {"Bucket": "signed", "Key": f"uploads/{key}"}
            url = s3.generate_presigned_url("put_object", Params=params, ExpiresIn=600)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(url.encode())

        def log_message(self, *args):
            pass

    signer = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Signer)
    threading.Thread(target=signer.serve_forever, daemon=True).start()
    try:
        service = f"http://127.0.0.1:{signer.server_address[1]}/sign"
        store = open_store(StoreConfig(presigned_url_service=service), tmp_path, "run")
        store.append(episodes(3))
        assert store.close(upload_timeout_s=60) == []
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="signed")["Contents"]]
        assert len(keys) == 1 and keys[0].startswith("uploads/run=run/date=")
        body = s3.get_object(Bucket="signed", Key=keys[0])["Body"].read()
        assert pq.read_table(pa.BufferReader(body)).num_rows == 3
    finally:
        signer.shutdown()
        server.stop()


def test_a_full_disk_names_the_file_it_could_not_write(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does; the error names
    the run's file, which the bare errno does not."""
    journal = Journal(tmp_path / "journal")
    staging = tmp_path / "journal" / "000000000000-k.arrow.tmp"
    staging.symlink_to("/dev/full")
    with pytest.raises(OSError) as raised:
        journal.record("k", to_table([make_episode()]))
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(staging)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(OSError) as raised:
        MetricsLog(tmp_path).write({"step": 1, "padding": "x" * 65536})
    assert raised.value.filename == str(tmp_path / "metrics.jsonl")
    assert str(raised.value) == f"[Errno 28] No space left on device: '{tmp_path}/metrics.jsonl'"
