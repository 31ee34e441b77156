"""Actors killed with SIGKILL in real runs of `python jobs/ppo.py`: the run completes (or
fails naming the learner once its restarts are used up), and the store holds every scored
episode once: whole batches, each id once, every prompt trained on.

One run takes all the kills in turn (rollout, reward, buffer, store, then the learner,
after which the job resumes from its checkpoint by itself), so Ray and vLLM start once
for all of them.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from rlray.episodes import read
from tests.jobs_helper import SHORT_RUN, metrics
from tests.test_store_job import start_job, wait_until

pytestmark = pytest.mark.slow

PROMPTS_PER_BATCH = 8  # SHORT_RUN: one batch of 8 prompts x 4 samples per learner step
SAMPLES = 4


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(metrics(run_dir)) if path.exists() else 0


def kill(run_dir: Path, actor: str) -> None:
    """SIGKILLs the process of one of the run's actors (named in placement.json)."""
    pid = json.loads((run_dir / "placement.json").read_text())[actor]["pid"]
    os.kill(pid, signal.SIGKILL)


def attempts(run_dir: Path) -> dict[str, list[dict]]:
    """Returns the stored episodes grouped by generation attempt (the id's last part)."""
    table = read(run_dir / "episodes")
    columns = ["episode_id", "prompt_index", "sample_index", "trained_at"]
    rows = table.select(columns).to_pylist()
    ids = [row["episode_id"] for row in rows]
    assert len(ids) == len(set(ids)), "an episode id was stored twice"
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        grouped[row["episode_id"].rsplit("-", 1)[1]].append(row)
    return grouped


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


def test_every_actor_kind_killed_mid_run_loses_and_doubles_nothing(job_env, tmp_path):
    run_dir = tmp_path / "faults"
    steps = 9
    job = start_job(
        [*SHORT_RUN, "--learner.steps", str(steps), "--run-dir", str(run_dir)], job_env
    )
    try:
        for step, actor in enumerate(("rollout-0", "reward-0", "buffer", "store"), start=1):
            wait_until(lambda step=step: steps_logged(run_dir) >= step)
            kill(run_dir, actor)
        wait_until(lambda: steps_logged(run_dir) >= 5)  # a checkpoint at 3 (every 3 steps)
        kill(run_dir, "learner")
        _, err = job.communicate(timeout=900)
    finally:
        job.kill()
    assert job.returncode == 0, err[-4000:]
    resumed = re.search(r"learner died .*; resuming from step-(\d+)", err)
    assert resumed, err[-4000:]
    checkpoint = int(resumed[1])
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1))  # each once
    by_batch = check_whole_batches(attempts(run_dir))
    assert set(range(steps)) <= set(by_batch)
    for batch, trained in by_batch.items():
        if batch < checkpoint:  # trained before the checkpoint: exactly once
            assert trained.count(True) == 1, (batch, trained)
        elif batch < steps:  # trained again after the learner's death, by the resumed run
            assert 1 <= trained.count(True) <= 2, (batch, trained)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["final_eval_accuracy"] is not None


def test_learner_lost_more_often_than_allowed_fails_naming_it_and_keeps_episodes(
    job_env, tmp_path
):
    run_dir = tmp_path / "learner-lost"
    args = [*SHORT_RUN, "--learner.steps", "50", "--ray.max_job_restarts", "0"]
    job = start_job([*args, "--run-dir", str(run_dir)], job_env)
    try:
        wait_until(lambda: steps_logged(run_dir) >= 2)
        kill(run_dir, "learner")
        _, err = job.communicate(timeout=600)
    finally:
        job.kill()
    assert job.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("ppo.py: error: learner died") and "ray.max_job_restarts" in last
    by_batch = check_whole_batches(attempts(run_dir))
    trained = [b for b, t in sorted(by_batch.items()) if True in t]
    # Each logged step's batch trained once; one more if the learner died after its
    # update but before the step was logged (in its checkpoint or weight sync).
    assert trained == list(range(len(trained))) and len(trained) >= len(metrics(run_dir))
    assert all(t.count(True) <= 1 for t in by_batch.values())
    # The step the learner died in, and what was generated beyond it, kept untrained.
    assert any(t == [False] for t in by_batch.values())
