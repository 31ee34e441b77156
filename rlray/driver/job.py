"""The skeleton every job in jobs/ runs in: `run_job` owns what they all do alike.

A job is two functions: `check(argv)` turns the command line into a checked setup and
starts nothing; `work(setup)` does the job and returns its exit code. Around them:

- a ConfigError from `check` is one line, `<job>: error: ...`, and exit 2, before any
  actor starts;
- a job on Ray joins ray.address or RAY_ADDRESS, else starts a local Ray with the CPUs
  its actors reserve (ray.num_cpus if more), and prints its run directory;
- a failed actor (ActorFailure) is one line and exit 1; in a job that restarts, an actor
  that died for good (the learner, or its node) resumes the run from its last
  checkpoint instead, up to ray.max_job_restarts times;
- Ctrl-C, or SIGTERM (`ray job stop`), is one line and exit 130: "interrupted before
  ... began" until the job's work proper (`Job.working`) begins, then what it kept.

Each job's `main(argv)` returns run_job's exit code, so that a test can call it
in-process. Importing this module loads next to nothing (a job on Ray loads Ray when it
starts): a script imports it first, and `Job.stop_while_importing` covers its other
imports.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from rlray.core.interrupts import HELD_SIGNALS, stop_at_once_on_signals, stop_on_sigterm

if TYPE_CHECKING:
    from rlray.config import Config
    from rlray.driver.plan import RunPlan

Setup = TypeVar("Setup")


class JobEnded(Exception):
    """The job ended, its line said: run_job returns `code`."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class RunLost(Exception):
    """An actor died and Ray did not bring it back: the run resumes from its checkpoint."""


@dataclass(frozen=True)
class Job:
    """What run_job says for one job, and what the job runs on."""

    name: str
    """The script's file name: every line the skeleton writes starts with it."""
    began: str
    """What a Ctrl-C before `working` stops: "interrupted before {began} began"."""
    kept: str = ""
    """What a Ctrl-C during `working` leaves: "interrupted; {kept}"."""
    ray: bool = False
    """Whether the job runs actors on Ray: its setup then has `config` and `run_dir`."""
    restarts: bool = False
    """Whether an actor that died resumes the run (its setup is then a RunPlan)."""

    def say(self, line: str) -> None:
        """Writes one line to stderr, after the job's name."""
        print(f"{self.name}: {line}", file=sys.stderr, flush=True)

    def stop_while_importing(self) -> None:
        """Until run_job takes over, SIGINT and SIGTERM end the process at once, in the
        line of a job interrupted before it began (exit 130): a job's imports take
        seconds (Ray, torch, vLLM), and nothing has started that would need stopping."""
        line = f"{self.name}: interrupted before {self.began} began\n"

        def stop(signum: int, frame: object) -> None:
            sys.stderr.write(line)
            os._exit(130)

        for signum in HELD_SIGNALS:
            signal.signal(signum, stop)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """The job's work proper: a Ctrl-C or a failed actor in it ends the job, its line
        said at once. Inside the `try` whose `finally` stops the actors, so that the line
        comes before the wait for them."""
        try:
            yield
        except KeyboardInterrupt:
            self.say(f"interrupted; {self.kept}" if self.kept else "interrupted")
            raise JobEnded(130) from None
        except actor_failures(self) as err:
            if err.died and self.restarts:
                raise RunLost(str(err)) from err
            self.say(f"error: {err}")
            raise JobEnded(1) from None


def run_job(
    job: Job,
    argv: list[str] | None,
    check: Callable[[list[str]], Setup],
    work: Callable[[Setup], int],
) -> int:
    """Checks the arguments (sys.argv's without `argv`), joins Ray for a job on it and
    does the work; returns the exit code: 0 done, 1 failed, 2 bad input, 130 interrupted."""
    # Loaded already by the job's own imports; not at the top, which comes before the
    # job's signal guard (stop_while_importing).
    from rlray.config import ConfigError

    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here
    stop_on_sigterm()  # `ray job stop` (SIGTERM) stops a job as Ctrl-C does
    joined = False
    try:
        try:
            setup = check(sys.argv[1:] if argv is None else argv)
        except ConfigError as err:
            job.say(f"error: {err}")
            return 2
        if job.ray:
            joined = True
            join_ray(setup.config)
            print(f"run directory: {setup.run_dir}", flush=True)
        return _with_restarts(job, setup, work) if job.restarts else work(setup)
    except JobEnded as ended:
        return ended.code
    except actor_failures(job) as err:  # while the actors start
        job.say(f"error: {err}")
        return 1
    except KeyboardInterrupt:
        job.say(f"interrupted before {job.began} began")
        return 130
    finally:
        if joined:
            stop_at_once_on_signals()  # Ray shuts down at exit: a signal then ends it at once


def join_ray(config: Config) -> None:
    """Joins ray.address or RAY_ADDRESS, else starts a local Ray with ray.num_cpus
    logical CPUs, and at least what a training run's actors reserve (a job with fewer
    actors has room to spare)."""
    # Ray loads here, for a job on it: the jobs that read a store start in a moment.
    from rlray.cluster.connection import connect, required_cpus

    connect(config.ray.address, max(config.ray.num_cpus, int(required_cpus(config) + 0.999)))


def actor_failures(job: Job) -> tuple[type[Exception], ...]:
    """Returns the exceptions of a failed actor, none for a job without actors."""
    if not job.ray:
        return ()
    # Loaded already by a job on Ray (its actors are called through it).
    from rlray.cluster.calls import ActorFailure

    return (ActorFailure,)


def _with_restarts(job: Job, plan: RunPlan, work: Callable[[RunPlan], int]) -> int:
    """Does the work, resuming the run from its latest checkpoint each time an actor is
    lost for good, up to ray.max_job_restarts times; returns the exit code."""
    for restart in itertools.count():
        try:
            return work(plan)
        except RunLost as lost:
            if restart == plan.config.ray.max_job_restarts:
                job.say(f"error: {lost} (gave up after {restart} restarts: ray.max_job_restarts)")
                return 1
            plan = plan.resumed()
            start = plan.checkpoint.name if plan.checkpoint else "the start"
            job.say(f"{lost}; resuming from {start}")
    raise AssertionError("unreachable")
