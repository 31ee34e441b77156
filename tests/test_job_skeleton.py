"""The skeleton every job runs in (rlray/driver/job.py), in-process and without Ray: each
way a job ends is one line and its exit code, a lost actor restarts a run that restarts,
and jobs/ppo.py reads on one screen."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import rlray.driver.job
from rlray.cluster.calls import ActorFailure
from rlray.config import Config, ConfigError
from rlray.driver.job import Job, run_job
from tests.jobs_helper import REPO

TRAINING = Job("train.py", began="training", kept="every episode is kept", ray=True)


@dataclass
class Plan:
    """Stands in for a RunPlan: what the skeleton reads of one."""

    config: Config = field(default_factory=Config)
    run_dir: Path = Path("runs/x")
    checkpoint: Path | None = None

    def resumed(self) -> Plan:
        return Plan(self.config, self.run_dir, Path(f"step-{id(self) % 1000:06d}"))


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Joining Ray is recorded, not done; the test's signal handlers come back after it."""
    joined = []
    monkeypatch.setattr(rlray.driver.job, "join_ray", joined.append)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield joined
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def test_a_config_error_is_one_line_and_exit_2_before_ray(no_ray, capsys):
    def check(argv):
        raise ConfigError(f"learner.lr must be > 0, got {argv[1]}")

    assert run_job(TRAINING, ["--learner.lr", "-1"], check, lambda plan: 0) == 2
    assert capsys.readouterr().err == "train.py: error: learner.lr must be > 0, got -1\n"
    assert no_ray == []


def test_a_job_on_ray_joins_it_and_names_its_run_directory(no_ray, capsys):
    plan = Plan()
    assert run_job(TRAINING, [], lambda argv: plan, lambda plan: 0) == 0
    assert no_ray == [plan.config]
    assert capsys.readouterr().out == "run directory: runs/x\n"


def interrupted(plan: Plan) -> int:
    raise KeyboardInterrupt


def test_ctrl_c_before_the_work_began_is_one_line_and_exit_130(capsys):
    assert run_job(TRAINING, [], lambda argv: Plan(), interrupted) == 130
    assert capsys.readouterr().err == "train.py: interrupted before training began\n"


def test_ctrl_c_in_the_work_is_said_at_once_before_the_actors_stop(capsys):
    said = []

    def work(plan: Plan) -> int:
        try:
            with TRAINING.working():
                interrupted(plan)
        finally:
            said.append(capsys.readouterr().err)  # the actors would stop here
        return 0

    assert run_job(TRAINING, [], lambda argv: Plan(), work) == 130
    assert said == ["train.py: interrupted; every episode is kept\n"]


def test_a_failed_actor_is_one_line_and_exit_1(capsys):
    def work(plan: Plan) -> int:
        with TRAINING.working():
            raise ActorFailure("learner died: its process was killed", died=True)

    assert run_job(TRAINING, [], lambda argv: Plan(), work) == 1
    assert capsys.readouterr().err == "train.py: error: learner died: its process was killed\n"


def test_an_actor_that_fails_to_start_is_one_line_and_exit_1(capsys):
    def work(plan: Plan) -> int:
        raise ActorFailure("rollout-0 did not start in 600 s")

    assert run_job(TRAINING, [], lambda argv: Plan(), work) == 1
    assert capsys.readouterr().err == "train.py: error: rollout-0 did not start in 600 s\n"


def test_a_lost_actor_resumes_the_run_until_the_restarts_are_spent(capsys):
    job = Job("train.py", began="training", ray=True, restarts=True)
    plan = Plan()
    plan.config.ray.max_job_restarts = 2
    starts = []

    def work(plan: Plan) -> int:
        starts.append(plan.checkpoint)
        with job.working():
            raise ActorFailure("learner died", died=True)

    assert run_job(job, [], lambda argv: plan, work) == 1
    assert starts[0] is None and len(starts) == 3 and all(starts[1:])
    assert capsys.readouterr().err.splitlines() == [
        f"train.py: learner died; resuming from {starts[1]}",
        f"train.py: learner died; resuming from {starts[2]}",
        "train.py: error: learner died (gave up after 2 restarts: ray.max_job_restarts)",
    ]


def test_an_actor_error_that_is_not_a_death_does_not_restart(capsys):
    job = Job("train.py", began="training", ray=True, restarts=True)
    starts = []

    def work(plan: Plan) -> int:
        starts.append(plan)
        with job.working():
            raise ActorFailure("learner: train step timed out")

    assert run_job(job, [], lambda argv: Plan(), work) == 1
    assert len(starts) == 1
    assert capsys.readouterr().err == "train.py: error: learner: train step timed out\n"


def test_a_job_without_ray_joins_none(no_ray):
    job = Job("read.py", began="reading")
    assert run_job(job, ["x"], lambda argv: argv, lambda argv: len(argv)) == 1
    assert no_ray == []


def test_the_ppo_job_reads_on_one_screen():
    lines = (REPO / "jobs" / "ppo.py").read_text().splitlines()
    assert len(lines) <= 100, len(lines)
