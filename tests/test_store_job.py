"""The episode store and the ingestion endpoint in real runs of `python jobs/ppo.py`:
a real S3 server (moto) that goes away mid-run and comes back, one that never comes
back, and episodes posted over HTTP while the job trains."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import boto3
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from moto.server import ThreadedMotoServer

from rlray.episodes import read
from tests.conftest import AWS_TEST_CREDENTIALS, free_port
from tests.jobs_helper import REPO, SHORT_RUN, metrics

pytestmark = pytest.mark.slow

AWS_ENV = AWS_TEST_CREDENTIALS


def start_job(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "ppo.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def trained_steps(run_dir) -> list[int]:
    """Returns, per logged learner step, how many posted episodes it trained on
    (beyond its whole batches of 32)."""
    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [r["episodes"] % 32 for r in metrics(run_dir)]


def prompt_samples(table) -> set[tuple[int, int]]:
    """Returns the (prompt index, sample index) pairs of a table of episodes."""
    return set(
        zip(
            table.column("prompt_index").to_pylist(),
            table.column("sample_index").to_pylist(),
            strict=True,
        )
    )


def wait_until(condition, timeout_s: float = 300, every_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(every_s)


def test_every_episode_reaches_s3_across_an_outage(job_env, tmp_path, monkeypatch):
    for key, value in AWS_ENV.items():
        monkeypatch.setenv(key, value)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket="episodes")
    steps, run_dir = 8, tmp_path / "s3run"
    job = start_job(
        [
            *SHORT_RUN,
            "--learner.steps",
            str(steps),
            "--run-dir",
            str(run_dir),
            "--store.path",
            "s3://episodes/rl",
            "--store.s3_endpoint_url",
            endpoint,
            "--store.rows_per_file",
            "32",
        ],
        {**job_env, **AWS_ENV},
    )
    try:
        # Once the first file has landed, S3 goes away for a while mid-run.
        wait_until(lambda: s3.list_objects_v2(Bucket="episodes").get("KeyCount", 0) > 0)
        server.stop()
        time.sleep(4)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        _, err = job.communicate(timeout=600)
        assert job.returncode == 0, err[-3000:]
        table = read("s3://episodes/rl", endpoint_url=endpoint)
        expected = {(p, s) for p in range(steps * 8) for s in range(4)}
        ids = table.column("episode_id").to_pylist()
        assert len(ids) == len(set(ids)) and prompt_samples(table) == expected
        assert table.filter(table["trained_at"].is_null()).num_rows == 0  # all trained on
        assert not list((run_dir / "episode-spool").glob("*.data"))
    finally:
        job.kill()
        server.stop()


def test_a_run_whose_s3_never_comes_back_finishes_and_names_the_spool(job_env, tmp_path):
    run_dir = tmp_path / "offline"
    nowhere = f"http://127.0.0.1:{free_port()}"
    job = start_job(
        [
            *SHORT_RUN,
            "--learner.steps",
            "2",
            "--run-dir",
            str(run_dir),
            "--store.path",
            "s3://episodes/rl",
            "--store.s3_endpoint_url",
            nowhere,
            "--store.upload_timeout_s",
            "3",
        ],
        {**job_env, **AWS_ENV},
    )
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    spool = run_dir / "episode-spool"
    assert f"wait in {spool}" in err
    spooled = list(spool.glob("*.data"))
    assert spooled  # kept locally, every episode of the run in them
    rows = sum(pq.read_metadata(f).num_rows for f in spooled)
    assert rows == 2 * 32
    assert json.loads((run_dir / "summary.json").read_text())["episodes_stored"] == 64


def test_posted_episodes_are_stored_once_and_ctrl_c_keeps_every_episode(job_env, tmp_path):
    """Episodes posted during a run are scored, stored once (a retried POST too) and
    trained on; then Ctrl-C stops the run, which keeps every scored episode."""
    port, run_dir = free_port(), tmp_path / "ingest"
    job = start_job(
        [
            *SHORT_RUN,
            "--learner.steps",
            "200",
            "--run-dir",
            str(run_dir),
            "--ingest.enabled",
            "true",
            "--ingest.port",
            str(port),
            "--ingest.train",
            "true",
        ],
        job_env,
    )
    health = f"http://127.0.0.1:{port}/v1/health"

    def up() -> bool:
        try:
            with urllib.request.urlopen(health, timeout=2):
                return True
        except OSError:
            return False

    try:
        wait_until(up)
        posted = [
            {
                "run_id": "outside",
                "episode_id": f"outside-{i}",
                "prompt": f"{i}+1=",
                "completion": str(i + 1),
                "columns": {"answer": str(i + 1)},
            }
            for i in range(3)
        ]
        body = json.dumps({"episodes": posted}).encode()
        answers = []
        for _ in range(2):  # the second POST is a client's retry
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/episodes",
                data=body,
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as response:
                answers.append(json.loads(response.read()))
        # Three steps, one of which trained the posted episodes beside a whole batch.
        wait_until(lambda: len(trained_steps(run_dir)) >= 3 and any(trained_steps(run_dir)))
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert answers[0]["accepted"] == 3 and answers[0]["scored"] == 3
    assert answers[0]["queued_for_training"] == 3
    assert answers[1] == {"accepted": 0, "duplicates": 3, "scored": 0, "queued_for_training": 0}
    assert job.returncode == 130, err[-3000:]
    assert "interrupted; every episode so far is kept" in err
    table = read(run_dir / "episodes")
    outside = [r for r in table.to_pylist() if r["run_id"] == "outside"]
    assert sorted(r["episode_id"] for r in outside) == ["outside-0", "outside-1", "outside-2"]
    assert all(r["reward"] == 1.0 for r in outside)  # scored by the run's exact_match
    assert all(r["trained_at"] is not None for r in outside)  # queued, then trained on
    # The run's own episodes: whole prompt batches 0..n-1, each prompt with all its
    # samples, each id once: nothing lost, nothing doubled.
    own = table.filter(pc.equal(table["run_id"], run_dir.name))
    ids = own.column("episode_id").to_pylist()
    trained = sum(r["episodes"] for r in metrics(run_dir)) - len(outside)
    assert len(ids) == len(set(ids)) and len(ids) >= trained
    prompts = set(own.column("prompt_index").to_pylist())
    assert prompts == set(range(len(prompts))) and len(prompts) % 8 == 0
    assert prompt_samples(own) == {(p, s) for p in prompts for s in range(4)}
    assert len(ids) == 4 * len(prompts)


def test_collect_job_writes_every_episode_without_training(job_env, tmp_path):
    run_dir = tmp_path / "collect"
    collect = [sys.executable, str(REPO / "jobs" / "collect.py")]
    args = ["--prompts", "20", "--rollout.prompts_per_batch", "8", "--run-dir", str(run_dir)]
    result = subprocess.run(
        [*collect, *args], cwd=REPO, env=job_env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = read(run_dir / "episodes")
    expected = {(p, s) for p in range(20) for s in range(4)}
    assert prompt_samples(table) == expected and table.num_rows == 80
    assert len(set(table.column("episode_id").to_pylist())) == 80
    assert table["trained_at"].null_count == 80  # collected, never trained on
    assert table["reward"].null_count == 0
    assert json.loads((run_dir / "summary.json").read_text())["episodes_stored"] == 80
    no_count = subprocess.run(
        [*collect, "--run-dir", str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True
    )
    assert no_count.returncode == 2
    assert "--prompts: the built-in task has no end" in no_count.stderr
