"""`python jobs/ppo.py` stopped from outside: a SIGTERM while its actors start is one line
and exit 130, a SIGTERM to its whole process group ends it, and a driver killed outright
takes its local Ray with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlray.episodes.reader import read
from tests.jobs_helper import REPO, SHORT_RUN, metrics

pytestmark = pytest.mark.slow


def start_job(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "ppo.py"), *SHORT_RUN, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_line(job: subprocess.Popen, prefix: str, anywhere: bool = False) -> None:
    """Reads the job's output up to a line that starts with `prefix` (or, `anywhere`,
    holds it)."""
    for line in job.stdout:
        if line.startswith(prefix) or (anywhere and prefix in line):
            return
    raise AssertionError(f"the job ended before printing {prefix!r}")


# A reward that prints, as one being debugged does: from the child process that runs
# user rewards, its lines go to the scoring actor's log file.
LOUD_REWARD = """
def loud(prompts, completions, **kwargs):
    print(f"my reward scored {len(completions)} completions", flush=True)
    return [0.0] * len(completions)
"""


SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def blocked_signals(pid: int) -> int:
    """Returns the process's blocked-signal mask (its main thread's), bit n-1 for signal n."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk in /proc/{pid}/status")


# Two instants while Ray starts: half a second in (a timer), and inside the hooks Python
# runs around a fork (as ray.init starts a process), where an exception a signal handler
# raises is ignored: Ray's handler's SystemExit was lost there, and the job ran on.
SEND_SIGTERM = {
    "timer": "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()",
    "fork": """
sent = []
def send_once():
    if not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
os.register_at_fork(after_in_parent=send_once)
""",
}


@pytest.mark.parametrize("when", sorted(SEND_SIGTERM))
def test_a_sigterm_while_ray_starts_reaches_the_callers_handler_not_rays(when):
    # ray.init installs SIGTERM handlers that exit at once; the caller's handler (the
    # job's: stop as Ctrl-C does) must be the one a SIGTERM reaches.
    script = f"""
import os, signal, sys, threading
from rlray.cluster.connection import connect

def stop(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGTERM, stop)
{SEND_SIGTERM[when]}
try:
    connect("", 2)
    threading.Event().wait(60)
except KeyboardInterrupt:
    sys.exit(7)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 7, done.stderr[-3000:]


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_sigterm_while_actors_start_is_one_line_and_exit_130(job_env, tmp_path):
    job = start_job(["--learner.steps", "50", "--run-dir", str(tmp_path / "run")], job_env)
    try:
        wait_for_line(job, "run directory:")  # Ray joined; the actors are starting
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "ppo.py: interrupted before training began"


def in_session(session: int) -> list[psutil.Process]:
    """Returns the live processes of a session (a job started with start_new_session)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session and alive(process):
                found.append(process)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


@pytest.mark.parametrize("delay_s", [0.3, 1.5, 4.0])
def test_a_signal_at_any_instant_of_start_up_is_one_line_exit_130_and_leaves_nothing(
    job_env, tmp_path, delay_s
):
    # While the job imports (0.3 s), checks its config and model (1.5 s), starts Ray (4 s).
    env = {k: v for k, v in job_env.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    job = start_job(["--learner.steps", "50", "--run-dir", str(tmp_path / "run")], env)
    try:
        time.sleep(delay_s)
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "ppo.py: interrupted before training began"
    assert "step " not in out  # never trained
    deadline = time.monotonic() + 30  # two pytest workers: the machine may be busy
    while (left := in_session(job.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], [p.cmdline()[:1] for p in left]


def test_a_killed_driver_takes_its_local_ray_with_it(tmp_path):
    """SIGKILL of a driver that started its own Ray: within 10 s no process of that Ray
    is left (its dashboard and runtime-env agents outlived it by a minute before)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    run_dir = tmp_path / "run"
    (tmp_path / "loud.py").write_text(LOUD_REWARD)
    rewards = f"[{{name: exact_match}}, {{name: '{tmp_path / 'loud.py'}:loud'}}]"
    job = start_job(
        ["--learner.steps", "50", "--reward.functions", rewards, "--run-dir", str(run_dir)], env
    )
    try:
        # Every actor is up. Anywhere in a line: Ray's forwarding thread writes an actor's
        # line and its newline apart, and the driver's line can land between the two.
        wait_for_line(job, "eval  step    0", anywhere=True)
        # An actor's output reaches the driver's console...
        wait_for_line(job, "my reward scored", anywhere=True)
        ray_processes = psutil.Process(job.pid).children(recursive=True)
        names = {p.name() for p in ray_processes}
        assert {"raylet", "gcs_server"} <= names, names
        # ...though its own Ray starts neither the autoscaler's monitor nor the API
        # server, which it never uses, nor the log monitor, which runs in the driver.
        scripts = {Path(arg).name for p in ray_processes for arg in p.cmdline()}
        assert not {"monitor.py", "dashboard.py", "log_monitor.py"} & scripts, scripts
        # Each can be stopped by the SIGTERM of Ray's own shutdown (a mask blocked in the
        # driver was inherited by all of them: each killed a second later instead).
        blocking = [p.name() for p in ray_processes if blocked_signals(p.pid) & SIGTERM_BIT]
        assert blocking == [], blocking
        job.kill()
        job.wait(timeout=30)
        deadline = time.monotonic() + 30  # two pytest workers: the machine may be busy
        while (left := [p for p in ray_processes if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], [p.cmdline()[:1] for p in left]
    finally:
        job.kill()


def test_a_sigterm_to_the_whole_process_group_ends_the_run_and_its_local_ray(tmp_path):
    """`timeout` and `kill -- -PGID` signal every process of the group. The job's own Ray
    runs in a group of its own: the driver stops as on Ctrl-C, sends the episodes in
    flight to the store and then ends its Ray. (When the SIGTERM reached the raylet too,
    the driver's first call to it after the signal exited the process with status 1.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    run_dir = tmp_path / "run"
    job = start_job(["--learner.steps", "100000", "--run-dir", str(run_dir)], env)
    try:
        # A training step's line ("eval  step    0" comes first, before any is trained).
        wait_for_line(job, "/100000  reward", anywhere=True)
        ray_processes = psutil.Process(job.pid).children(recursive=True)
        assert {"raylet", "gcs_server"} <= {p.name() for p in ray_processes}
        in_the_jobs_group = [p.name() for p in ray_processes if os.getpgid(p.pid) == job.pid]
        os.killpg(job.pid, signal.SIGTERM)
        _, err = job.communicate(timeout=120)
        deadline = time.monotonic() + 30  # two pytest workers: the machine may be busy
        while (left := [p for p in ray_processes if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        job.kill()
    assert in_the_jobs_group == [], in_the_jobs_group
    assert job.returncode == 130, err[-3000:]
    assert "interrupted; every episode so far is kept" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert left == [], [p.cmdline()[:1] for p in left]
    # Every episode made, trained on or not, is in the store: whole prompts, each id once.
    episodes = read(str(run_dir / "episodes"))
    ids = episodes.column("episode_id").to_pylist()
    assert len(ids) == len(set(ids)) and len(ids) >= sum(r["episodes"] for r in metrics(run_dir))
    prompts = set(episodes.column("prompt_index").to_pylist())
    assert prompts == set(range(len(prompts))) and len(ids) == 4 * len(prompts)
