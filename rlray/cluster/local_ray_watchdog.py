"""Ends a job's local Ray when the job's driver dies, however it dies.

Ray ties its GCS and raylet to the driver that started them (they die with it), and
the actors' workers follow their raylet within seconds; but the dashboard and runtime-env
agents poll for their raylet and outlive a SIGKILLed driver by about a minute. The
driver starts this program right after `ray.init` with the read end of a pipe whose
write end only the driver holds, and the process ids (and start times) of the Ray it
started. The read returns once the driver has exited: then every one of those processes
still running is killed.

    python local_ray_watchdog.py FD PID:START [PID:START ...]

Standard library only, and started in a session of its own: it must outlive the
driver's process group.
"""

import contextlib
import os
import signal
import sys


def start_time(pid):
    """Returns the start time of process `pid` (clock ticks since boot), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[19])  # field 22 of proc(5), counted after the command's ")"


def main(fd, processes):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's
    while os.read(fd, 4096):  # b"": the driver has exited
        pass
    for pid, started in processes:
        if start_time(pid) == started:  # not a new process that took a freed pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    pairs = [arg.split(":") for arg in sys.argv[2:]]
    main(int(sys.argv[1]), [(int(pid), int(started)) for pid, started in pairs])
