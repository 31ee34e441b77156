"""Where a job's start-up goes: runs `python jobs/ppo.py ARGS` (each run with a run
directory of its own) and prints, for each run, the seconds from the command to the
step-0 evaluation's line and to the process's exit, with the CPU seconds each of the
run's processes had spent by that evaluation (sampled every half second).

    python benchmarks/start_up.py                          # the default job, 2 runs
    python benchmarks/start_up.py --runs 3 -- --learner.steps 1

Run it on an otherwise idle machine: the processes share its cores.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
FIRST_EVALUATION = "eval  step    0"


def process_name(process: psutil.Process) -> str | None:
    """Returns a run's process by role: Ray's names its actors' (ray::RolloutActor) and
    its own; the rest are the driver and Ray's head processes."""
    name = process.name()
    if name.startswith("ray::"):
        return name.split(".")[0].split(":")[-1]  # ray::rollout-0:RolloutActor.generate
    if name in ("raylet", "gcs_server"):
        return name
    if "jobs/ppo.py" in " ".join(process.cmdline()):
        return "driver"
    return None


def cpu_seconds(started: float) -> dict[str, float]:
    """Returns the CPU seconds of every process started since `started`, by role."""
    spent: dict[str, float] = collections.Counter()
    for process in psutil.process_iter():
        try:
            if process.create_time() < started - 1:
                continue
            name = process_name(process)
            if name:
                spent[name] += sum(process.cpu_times()[:2])
        except psutil.Error:  # gone meanwhile
            continue
    return spent


def one_run(args: list[str], run_dir: Path) -> tuple[float, float, dict[str, float]]:
    """Returns (seconds to the step-0 evaluation, seconds to exit, CPU seconds by role at
    that evaluation) of one job."""
    started = time.time()
    command = [
        sys.executable,
        "-u",
        str(REPO / "jobs" / "ppo.py"),
        *args,
        "--run-dir",
        str(run_dir),
    ]
    job = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    evaluated = threading.Event()
    first_evaluation = [0.0]

    def read() -> None:
        for line in job.stdout:
            if line.startswith(FIRST_EVALUATION) and not evaluated.is_set():
                first_evaluation[0] = time.time() - started
                evaluated.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    spent: dict[str, float] = {}
    while job.poll() is None and not evaluated.is_set():
        spent = cpu_seconds(started)
        evaluated.wait(0.5)
    job.wait(timeout=3600)
    reader.join(timeout=10)
    if job.returncode != 0:
        raise SystemExit(f"the job exited with {job.returncode}")
    return first_evaluation[0], time.time() - started, spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("job_args", nargs="*", help="arguments of jobs/ppo.py (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as runs:
        for run in range(args.runs):
            evaluation, exited, spent = one_run(args.job_args, Path(runs) / f"run-{run}")
            by_role = ", ".join(
                f"{name} {s:.1f}" for name, s in sorted(spent.items(), key=lambda kv: -kv[1])
            )
            print(f"run {run}: step-0 evaluation at {evaluation:.1f} s, exit at {exited:.1f} s")
            print(f"  CPU seconds by then: {by_role}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
