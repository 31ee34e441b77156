"""The episode store and the ingestion endpoint in real runs: episodes posted over HTTP
while `python jobs/ppo.py` trains and stores to a real S3 server (moto) that goes away
mid-run and comes back, then Ctrl-C; and `python jobs/collect.py` storing to an S3
endpoint that never comes back. Each job start costs tens of seconds of Ray and vLLM
start-up, so each test checks all it can of one run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import boto3
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from moto.server import ThreadedMotoServer

from rlray.episodes.reader import read
from tests.conftest import AWS_TEST_CREDENTIALS, free_port
from tests.jobs_helper import REPO, SHORT_RUN, kill, metrics

pytestmark = pytest.mark.slow

AWS_ENV = AWS_TEST_CREDENTIALS

POSTED = [
    {
        "run_id": "outside",
        "episode_id": f"outside-{i}",
        "prompt": f"{i}+1=",
        "completion": str(i + 1),
        "columns": {"answer": str(i + 1)},
    }
    for i in range(3)
]


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


def start_s3(port: int) -> ThreadedMotoServer:
    # moto keeps its buckets in this process, so a server restarted on the same port
    # serves what the stopped one held: an outage, not a new S3.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    return server


def s3_outage(server: ThreadedMotoServer, port: int, endpoint: str) -> ThreadedMotoServer:
    """Once the first file has landed, stops the server for 4 s; returns the new one."""
    s3 = boto3.client("s3", endpoint_url=endpoint)
    wait_until(lambda: s3.list_objects_v2(Bucket="episodes").get("KeyCount", 0) > 0)
    server.stop()
    time.sleep(4)
    return start_s3(port)


def ingest_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=2):
            return True
    except OSError:
        return False


def post_twice(port: int, episodes: list[dict]) -> list[dict]:
    """POSTs the episodes, then again as a client's retry; returns both answers."""
    body = json.dumps({"episodes": episodes}).encode()
    answers = []
    for _ in range(2):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/episodes",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as response:
            answers.append(json.loads(response.read()))
    return answers


def test_posted_episodes_reach_s3_once_across_an_outage_and_ctrl_c_keeps_every_episode(
    job_env, tmp_path, monkeypatch
):
    """Episodes posted during a run are scored, stored once (a retried POST too) and
    trained on; S3 goes away mid-run and comes back; then Ctrl-C stops the run, which
    keeps every scored episode, all of them uploaded."""
    for key, value in AWS_ENV.items():
        monkeypatch.setenv(key, value)  # for this process's boto3 and read()
    s3_port = free_port()
    endpoint = f"http://127.0.0.1:{s3_port}"
    server = start_s3(s3_port)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="episodes")
    port, run_dir = free_port(), tmp_path / "ingest"
    # Steps to outlast the test: a run that ends before the Ctrl-C exits 0 (200 steps did,
    # twice in one day's suites); a Ctrl-C that is lost times out below.
    job = start_job(
        [
            *SHORT_RUN,
            "--learner.steps",
            "100000",
            "--run-dir",
            str(run_dir),
            "--store.path",
            "s3://episodes/rl",
            "--store.s3_endpoint_url",
            endpoint,
            "--store.rows_per_file",
            "32",
            "--ingest.enabled",
            "true",
            "--ingest.port",
            str(port),
            "--ingest.train",
            "true",
        ],
        {**job_env, **AWS_ENV},
    )
    try:
        wait_until(lambda: ingest_up(port))
        answers = post_twice(port, POSTED)
        server = s3_outage(server, s3_port, endpoint)
        # Three steps, one of which trained the posted episodes beside a whole batch.
        wait_until(lambda: len(trained_steps(run_dir)) >= 3 and any(trained_steps(run_dir)))
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=300)
        table = read("s3://episodes/rl", endpoint_url=endpoint)
    finally:
        job.kill()
        server.stop()
    assert answers[0]["accepted"] == 3 and answers[0]["scored"] == 3
    assert answers[0]["queued_for_training"] == 3
    assert answers[1] == {"accepted": 0, "duplicates": 3, "scored": 0, "queued_for_training": 0}
    assert job.returncode == 130, err[-3000:]
    assert "interrupted; every episode so far is kept" in err
    # S3 came back before the run ended, so its close uploaded every spooled file.
    assert not list((run_dir / "episode-spool").glob("*.data"))
    outside = [r for r in table.to_pylist() if r["run_id"] == "outside"]
    assert sorted(r["episode_id"] for r in outside) == ["outside-0", "outside-1", "outside-2"]
    assert all(r["reward"] == 1.0 for r in outside)  # scored by the run's exact_match
    assert all(r["trained_at"] is not None for r in outside)  # queued, then trained on
    # The run's own episodes: whole prompt batches 0..n-1, each prompt with all its
    # samples, each id once: nothing lost, nothing doubled by the outage's retries.
    own = table.filter(pc.equal(table["run_id"], run_dir.name))
    assert own.num_rows + len(outside) == table.num_rows
    ids = own.column("episode_id").to_pylist()
    trained = sum(r["episodes"] for r in metrics(run_dir)) - len(outside)
    assert len(ids) == len(set(ids)) and len(ids) >= trained
    prompts = set(own.column("prompt_index").to_pylist())
    assert prompts == set(range(len(prompts))) and len(prompts) % 8 == 0
    assert prompt_samples(own) == {(p, s) for p in prompts for s in range(4)}
    assert len(ids) == 4 * len(prompts)


GATE = """
import os
import time


def gate(completions, **kwargs):
    # Scores nothing until the test opens the gate: the run cannot end before its kills.
    while not os.path.exists(os.environ["RLRAY_TEST_GATE"]):
        time.sleep(0.05)
    return [0.0 for _ in completions]
"""


def test_collect_job_keeps_every_episode_in_the_spool_when_s3_never_comes_back(job_env, tmp_path):
    """jobs/collect.py scores every (prompt, sample) once and trains on none, through a
    dead rollout worker and a dead reward worker (the training driver's recovery);
    storing to an S3 endpoint nobody listens on, it still finishes and says where the
    files wait."""
    run_dir = tmp_path / "collect"
    nowhere = f"http://127.0.0.1:{free_port()}"
    collect = [sys.executable, str(REPO / "jobs" / "collect.py")]
    rewards = tmp_path / "gate.py"
    rewards.write_text(GATE)
    opened = tmp_path / "open"
    args = [
        *["--prompts", "96", "--rollout.prompts_per_batch", "8", "--run-dir", str(run_dir)],
        *["--store.path", "s3://episodes/rl", "--store.s3_endpoint_url", nowhere],
        *["--store.upload_timeout_s", "3"],
        *["--reward.functions", f"[{{name: exact_match}}, {{name: '{rewards}:gate'}}]"],
        # A reward actor of its own (by default the store's process scores).
        *["--reward.num_workers", "1"],
    ]
    with (tmp_path / "collect.out").open("w") as out:
        job = subprocess.Popen(
            [*collect, *args],
            cwd=REPO,
            env={**job_env, **AWS_ENV, "RLRAY_TEST_GATE": str(opened)},
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        # Kept from scoring by the gate, the run is at its first batch or two: the
        # rollout worker dies before, in or between its calls, the reward worker in
        # its first (or before it), and the run goes on.
        wait_until(lambda: (run_dir / "placement.json").exists())
        kill(run_dir, "rollout-0")
        kill(run_dir, "reward-0")
        opened.touch()
        _, stderr = job.communicate(timeout=600)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # Ray restarted each once, and the driver counted it.
    restarts = summary["actor_restarts"]
    assert restarts == {"rollout-0": 1, "reward-0": 1}, (summary, stderr[-3000:])
    spool = run_dir / "episode-spool"
    assert f"they wait in {spool}" in stderr
    spooled = sorted(spool.glob("*.data"))
    assert spooled  # kept locally, every episode of the run in them
    table = pa.concat_tables([pq.read_table(f) for f in spooled])
    expected = {(p, s) for p in range(96) for s in range(4)}
    assert prompt_samples(table) == expected and table.num_rows == 384
    assert len(set(table.column("episode_id").to_pylist())) == 384
    assert table["trained_at"].null_count == 384  # collected, never trained on
    assert table["reward"].null_count == 0
    assert summary["episodes_stored"] == 384
    no_count = subprocess.run(
        [*collect, "--run-dir", str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True
    )
    assert no_count.returncode == 2
    assert "--prompts: the built-in task has no end" in no_count.stderr
