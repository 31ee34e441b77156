"""Runs `python jobs/ppo.py` as users do, joined to the test session's Ray cluster."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A few fast steps: 32 episodes a step in two micro-batches, a small held-out set;
# strictly on-policy, so that runs repeat step for step (same seed, resume) and every
# generated batch is trained on. The default overlap (max_staleness 1) has tests of its
# own (test_job's overlap test, test_actors).
SHORT_RUN = [
    "--buffer.max_staleness",
    "0",
    "--learner.episodes_per_step",
    "32",
    "--rollout.prompts_per_batch",
    "8",
    "--learner.minibatch_size",
    "16",
    "--learner.micro_batch_size",
    "8",
    "--data.eval_size",
    "40",
    "--learner.eval_every",
    "5",
    "--learner.checkpoint_every",
    "3",
]


def run_job(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Returns the finished `python jobs/ppo.py ARGS` process (stdout and stderr text)."""
    return subprocess.run(
        [sys.executable, str(REPO / "jobs" / "ppo.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_example(
    example: str, steps: int, run_dir: Path, env: dict[str, str], more: Sequence[str] = ()
) -> subprocess.CompletedProcess:
    """Returns the finished job of examples/EXAMPLE.yaml (and `more` arguments) for
    `steps` steps, evaluated at the start and the end, in `run_dir`; fails the caller
    unless it succeeded."""
    args = ["--config", str(REPO / "examples" / f"{example}.yaml"), "--learner.steps", str(steps)]
    args += ["--learner.eval_every", str(steps), "--run-dir", str(run_dir), *more]
    result = run_job(args, env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_jobs_at_once(
    arg_lists: list[list[str]], env: dict[str, str], timeout: float = 600
) -> list[subprocess.CompletedProcess]:
    """Returns the finished `python jobs/ppo.py ARGS` processes of jobs started together
    (their start-ups overlap: one job's driver waits on its actors while another's
    import). Output goes to files, so that no job blocks on a full pipe."""
    with contextlib.ExitStack() as stack:
        outputs = [
            [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2)] for _ in arg_lists
        ]
        jobs = [
            subprocess.Popen(
                [sys.executable, str(REPO / "jobs" / "ppo.py"), *args],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=err,
                text=True,
            )
            for args, (out, err) in zip(arg_lists, outputs, strict=True)
        ]
        try:
            for job in jobs:
                job.wait(timeout=timeout)
        finally:
            for job in jobs:
                job.kill()
        done = []
        for job, args, (out, err) in zip(jobs, arg_lists, outputs, strict=True):
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(args, job.returncode, out.read(), err.read()))
        return done


def pid_of(run_dir: Path, actor: str) -> int:
    """Returns the process id of one of the run's actors (placement.json names it)."""
    return json.loads((run_dir / "placement.json").read_text())[actor]["pid"]


def kill(run_dir: Path, actor: str) -> None:
    """SIGKILLs the process of one of the run's actors."""
    os.kill(pid_of(run_dir, actor), signal.SIGKILL)


def metrics(run_dir: Path) -> list[dict]:
    """Returns the learner-step lines of a run's metrics.jsonl (step 0 left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["step"] > 0]


SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Returns (series, labels, value) of every labelled sample at a Prometheus endpoint."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = dict(LABEL.findall(match["labels"]))
            samples.append((match["name"], labels, float(match["value"])))
    return samples


def series_name(name: str, kind: str) -> str:
    """Returns the Prometheus series under which Ray exports rlray's metric `name`."""
    return f"ray_{name}" + {"counter": "_total", "histogram": "_count"}.get(kind, "")
