"""Actors killed with SIGKILL in a real run of `python jobs/ppo.py`: the run carries on
(and fails naming the learner once its restarts are used up), and the store holds every
scored episode once: whole batches, each id once, every step's batch trained on.

One run takes all the kills in turn (rollout; the store, with the buffer and the
scoring in its process; the store's second shard; then the learner, after which the job
resumes from its checkpoint by itself;
then the learner again, which ends the job as `ray.max_job_restarts` 1 allows one
resume), so Ray and vLLM start once for all of them. It syncs weights through vLLM's
weight transfer (gloo): the restarted rollout worker loads them from the object store
(as does the sync its death cut short, if it died in one), and the next sync opens the
transfer to its new engine (and the resumed job's to its new actors). It runs the
long-tail task (examples/countdown.yaml) with in-flight weight updates a batch ahead,
so requests are running across kills, syncs and the checkpoint (measured: 10-14 of
256-352 stored episodes span a sync); a batch is stored, trained and regenerated
whole, never in part.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from rlray.episodes.reader import read
from tests.jobs_helper import REPO, SHORT_RUN, kill, metrics, pid_of
from tests.test_store_job import wait_until

pytestmark = pytest.mark.slow

PROMPTS_PER_BATCH = 8  # SHORT_RUN: one batch of 8 prompts x 4 samples per learner step
SAMPLES = 4


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(metrics(run_dir)) if path.exists() else 0


def restarts_logged(run_dir: Path) -> dict[str, int]:
    """Returns the actor restarts the run's last logged step counted."""
    return metrics(run_dir)[-1]["actor_restarts"] if steps_logged(run_dir) else {}


def attempts(run_dir: Path) -> dict[str, list[dict]]:
    """Returns the stored episodes grouped by generation attempt (the id's last part)."""
    table = read(run_dir / "episodes")
    columns = ["episode_id", "prompt_index", "sample_index", "trained_at"]
    rows = table.select([*columns, "policy_version", "last_policy_version"]).to_pylist()
    ids = [row["episode_id"] for row in rows]
    assert len(ids) == len(set(ids)), "an episode id was stored twice"
    # A request that ran across a sync finished under the next version, never later.
    for row in rows:
        assert row["policy_version"] <= row["last_policy_version"] <= row["policy_version"] + 1
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        grouped[row["episode_id"].rsplit("-", 1)[1]].append(row)
    return grouped


def start_job(args: list[str], env: dict[str, str], output: Path) -> subprocess.Popen:
    """Starts `python jobs/ppo.py`, its output going to output.out and output.err: read
    while it runs (a pipe is read only at the end), they say where a wait stopped."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "ppo.py"), *args],
        cwd=REPO,
        env=env,
        stdout=output.with_suffix(".out").open("w"),
        stderr=output.with_suffix(".err").open("w"),
        text=True,
    )


def check_whole_batches(grouped: dict[str, list[dict]]) -> dict[int, list[bool]]:
    """Asserts every stored attempt is one whole batch (8 prompts x 4 samples, trained
    or not as one); returns {batch index: [trained?] per stored attempt}."""
    by_batch: dict[int, list[bool]] = defaultdict(list)
    for rows in grouped.values():
        first = min(row["prompt_index"] for row in rows)
        assert first % PROMPTS_PER_BATCH == 0
        expected = {(first + p, s) for p in range(PROMPTS_PER_BATCH) for s in range(SAMPLES)}
        assert {(row["prompt_index"], row["sample_index"]) for row in rows} == expected
        assert len(rows) == len(expected)
        trained = {row["trained_at"] is not None for row in rows}
        assert len(trained) == 1, "part of a batch was marked trained"
        by_batch[first // PROMPTS_PER_BATCH].append(trained.pop())
    return by_batch


KILLED_ONCE = ("rollout-0", "store", "store-1")
"""A rollout worker, the store (with the buffer and the scorer) and the store's second
shard, each killed once, a step apart."""


def test_every_actor_kind_killed_mid_run_loses_and_doubles_nothing(job_env, tmp_path):
    run_dir = tmp_path / "faults"
    args = [*SHORT_RUN, "--learner.steps", "50", "--ray.max_job_restarts", "1"]
    args += ["--rollout.weight_sync", "gloo"]
    # The long-tail task with in-flight updates, a batch ahead: requests are running
    # across kills, syncs and checkpoints.
    args += ["--config", str(REPO / "examples" / "countdown.yaml"), "--buffer.max_staleness", "1"]
    args += ["--store.shards", "2"]  # store-1 writes every other step's episodes
    output = tmp_path / "job"
    job = start_job([*args, "--run-dir", str(run_dir)], job_env, output)
    try:
        # The store's process holds the buffer and scores: one kill restarts and restores
        # both, and fails the scoring calls in flight.
        for step, actor in enumerate(KILLED_ONCE, start=1):
            wait_until(lambda step=step: steps_logged(run_dir) >= step)
            kill(run_dir, actor)
            # Seen by the run before the next kill: a resume would forget it.
            wait_until(lambda actor=actor: restarts_logged(run_dir).get(actor) == 1)
        wait_until(lambda: steps_logged(run_dir) >= 5)  # a checkpoint at 3 (every 3 steps)
        first_learner = pid_of(run_dir, "learner")
        kill(run_dir, "learner")  # the job resumes from step 3 by itself...
        wait_until(lambda: pid_of(run_dir, "learner") != first_learner)
        wait_until(lambda: steps_logged(run_dir) >= 5)
        kill(run_dir, "learner")  # ...but only once (ray.max_job_restarts 1)
        job.wait(timeout=900)
    except (AssertionError, subprocess.TimeoutExpired) as failure:
        tail = output.with_suffix(".err").read_text()[-4000:]
        raise AssertionError(f"{failure}; the job's stderr ends with:\n{tail}") from failure
    finally:
        job.kill()
    err = output.with_suffix(".err").read_text()
    assert job.returncode == 1, err[-4000:]
    resumed = re.search(r"learner died.*; resuming from step-(\d+)", err)
    assert resumed, err[-4000:]
    checkpoint = int(resumed[1])
    last = err.strip().splitlines()[-1]
    assert last.startswith("ppo.py: error: learner died"), last
    assert "gave up after 1 restarts: ray.max_job_restarts" in last
    # Each actor killed once is one restart, logged once, however many calls it failed
    # (Ray's own count; the resumed run's new actors count from 0).
    for actor in KILLED_ONCE:
        assert re.findall(rf"^{actor} restarted \(restart (\d+) of this run\)$", err, re.M) == [
            "1"
        ], actor
    records = metrics(run_dir)
    logged = [r["step"] for r in records]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= 5  # each once
    # Every sync went through the transfer, before and after the rollout worker's
    # restart (the next sync reopened it), but at most the one its death cut short,
    # which the object store finished; each left the worker holding its step.
    paths = [r["weight_sync"] for r in records]
    assert set(paths) <= {"gloo", "object_store"} and paths.count("object_store") <= 1
    assert paths[-1] == "gloo"
    assert all(r["weight_versions_loaded"] == {"rollout-0": r["step"]} for r in records)
    assert all(r["logprob_parity_error"] <= 1e-4 for r in records)
    by_batch = check_whole_batches(attempts(run_dir))
    trained = [batch for batch, marks in sorted(by_batch.items()) if True in marks]
    # Every logged step's batch was trained (one more if the learner died after an
    # update, before its step was logged), the steps after the checkpoint twice at most.
    assert trained == list(range(len(trained))) and len(trained) >= len(logged)
    for batch, marks in by_batch.items():
        assert marks.count(True) <= (1 if batch < checkpoint else 2), (batch, marks)


def test_a_resume_mid_flight_with_partial_rollouts_trains_no_prompt_twice(job_env, tmp_path):
    """Partial rollouts (a colocated engine with in-flight updates) leave a long-tail
    task's slow groups running from one batch to the next, so the prompts not yet trained
    on are not one run from a cursor: the checkpoint names them, and a resume after the
    colocated actor's death regenerates exactly those before going on."""
    run_dir = tmp_path / "partial"
    args = [*SHORT_RUN, "--config", str(REPO / "examples" / "countdown.yaml")]
    args += ["--ray.placement", "colocated", "--learner.steps", "6"]
    args += ["--learner.checkpoint_every", "1", "--ray.max_job_restarts", "1"]
    # A group is carried only while it stays fresh enough to train: generation a batch
    # ahead, and a group carried to the next batch, make two versions.
    args += ["--buffer.max_staleness", "2", "--rollout.in_flight_carry", "0.5"]
    output = tmp_path / "job"
    job = start_job([*args, "--run-dir", str(run_dir)], job_env, output)
    try:
        # The first checkpoint taken while an earlier prompt's group was still running
        # and later prompts were trained: a cursor alone (the lowest unfinished prompt)
        # would have those trained again.
        wait_until(lambda: job.poll() is not None or _a_checkpoint_with_a_gap(run_dir))
        assert job.poll() is None, "no checkpoint of the run had a prompt carried"
        killed_at = time.time()
        kill(run_dir, "learner")  # the learner and its engine: the job resumes
        job.wait(timeout=900)
    finally:
        job.kill()
    err = output.with_suffix(".err").read_text()
    assert job.returncode == 0, err[-4000:]
    resumed = re.search(r"resuming from .*(step-\d+)", err)
    assert resumed, err[-4000:]
    checkpoint = run_dir / "checkpoints" / resumed[1]
    state = json.loads((checkpoint / "state.json").read_text())
    assert _has_gap(state), state
    replay = state["replay_prompts"]
    saved_at = (checkpoint / "state.json").stat().st_mtime
    columns = ["prompt_index", "sample_index", "generated_at", "trained_at"]
    rows = read(run_dir / "episodes").select(columns).to_pylist()
    trained = Counter(
        (row["prompt_index"], row["sample_index"])
        for row in rows
        # What the learner kept: trained before the checkpoint, or after the resume (a
        # step trained between the checkpoint and the kill was lost with the learner).
        if row["trained_at"] is not None
        and not saved_at < row["trained_at"].timestamp() < killed_at
    )
    assert trained and max(trained.values()) == 1, trained.most_common(3)
    # The resumed run generated every prompt the checkpoint left unfinished again.
    regenerated = {r["prompt_index"] for r in rows if r["generated_at"].timestamp() > killed_at}
    assert regenerated >= set(replay)


def _has_gap(state: dict) -> bool:
    """Whether a checkpoint's unfinished prompts leave out some between their lowest and
    its cursor (those were trained)."""
    replay = state.get("replay_prompts") or []
    return bool(replay) and any(p not in replay for p in range(min(replay), state["prompt_cursor"]))


def _a_checkpoint_with_a_gap(run_dir: Path) -> bool:
    for path in (run_dir / "checkpoints").glob("step-*/state.json"):
        try:
            if _has_gap(json.loads(path.read_text())):
                return True
        except (OSError, ValueError):  # being written
            continue
    return False
