"""Ends a job's local Ray when the job's driver dies, however it dies.

Ray ties its GCS and raylet to the driver that started them (they die with it), and
the actors' workers follow their raylet within seconds; but the dashboard and runtime-env
agents poll for their raylet and outlive a SIGKILLed driver for a while. The
driver starts this program just before `ray.init` with the read end of a pipe whose
write end only the driver holds, and its own process id. Until the read returns (the
driver has exited) it notes, every second, the processes below the driver (and their
start times); then it kills every one of them still running, and every process of the
driver's Ray session (Ray names the session's directory `session_<time>_<driver pid>`)
that names that directory on its command line or holds a file there open (its log): an
agent the raylet started after the last note (a driver stopped while Ray started)
included.

    python local_ray_watchdog.py FD DRIVER_PID

Standard library only, and started in a session of its own: it must outlive the
driver's process group.
"""

import contextlib
import os
import re
import select
import signal
import sys
from pathlib import Path


def start_time(pid):
    """Returns the start time of process `pid` (clock ticks since boot), None if gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])  # field 22 of proc(5)


def _stat_fields(pid):
    """Returns /proc/<pid>/stat's fields after the command's ")" (field 3 on), or None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()
    except OSError:
        return None


def descendants(root):
    """Returns {pid: start time} of every process below `root`."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(entry.name)) is not None:
            children.setdefault(int(fields[1]), []).append((int(entry.name), int(fields[19])))
    found, pending = {}, [root]
    while pending:
        for pid, started in children.get(pending.pop(), []):
            found[pid] = started
            pending.append(pid)
    return found


def of_session(driver):
    """Returns {pid: start time} of every process of the driver's Ray session: its command
    line names the session's directory, or it holds a file there open (Ray's agents
    rename themselves, but write their output to the session's logs)."""
    session = re.compile(rf"/session_[0-9_-]+_{driver}(/|$)")
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if _names(entry, session) and (started := start_time(entry.name)) is not None:
            found[int(entry.name)] = started
    return found


def _names(process, session):
    try:
        command = (process / "cmdline").read_bytes().decode(errors="replace")
        if session.search(command.replace("\0", " ")):
            return True
        return any(session.search(_target(fd)) for fd in (process / "fd").iterdir())
    except OSError:  # gone, or not ours to read
        return False


def _target(fd):
    try:
        return os.readlink(fd)
    except OSError:  # closed since listed
        return ""


def main(fd, driver):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's
    known = {}
    while True:
        known.update(descendants(driver))  # agents Ray starts late are noted too
        known.pop(os.getpid(), None)  # this program, started by the driver too
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready and not os.read(fd, 4096):  # b"": the driver has exited
            break
    known.update(of_session(driver))
    for pid, started in known.items():
        if start_time(pid) == started:  # not a new process that took a freed pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
