"""A run's memory: the proportional set size (PSS) of its processes on the driver's node.

PSS charges each page shared by n processes 1/n to each, so the sum over processes
counts shared pages (torch's and vLLM's libraries, Ray's object store mappings) once,
where a sum of RSS would count them once per process. The run's processes are the
driver and everything it started (with a Ray of its own: Ray's processes and every
actor), plus the run's actors on this node and their children when it joined a cluster.
Linux only (`/proc/<pid>/smaps_rollup`); elsewhere the figures are None.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

GIB = 1024**3
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def pss_bytes(pid: int) -> int | None:
    """Returns a process's PSS in bytes, or None if it is gone or unreadable."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return None


def rss_bytes(pid: int) -> int | None:
    """Returns a process's resident set size in bytes (cheap to read, unlike PSS), or
    None if it is gone or unreadable."""
    try:
        resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * PAGE_BYTES


def with_descendants(pids: Iterable[int]) -> set[int]:
    """Returns the processes and all their descendants that still exist."""
    found: set[int] = set()
    for pid in pids:
        try:
            process = psutil.Process(pid)
            found.add(pid)
            found.update(child.pid for child in process.children(recursive=True))
        except psutil.Error:
            continue
    return found


def total_pss_bytes(pids: Iterable[int]) -> int | None:
    """Returns the summed PSS of the processes and their descendants (None off Linux)."""
    sizes = pss_by_process(pids)
    return sum(sizes.values()) if sizes else None


def pss_by_process(pids: Iterable[int]) -> dict[int, int]:
    """Returns the PSS of each of the processes and their descendants that has one."""
    sizes = {pid: pss_bytes(pid) for pid in with_descendants(pids)}
    return {pid: size for pid, size in sizes.items() if size is not None}


def process_label(pid: int, names: dict[int, str], owners: dict[int, str] | None = None) -> str:
    """Returns what to call a process: its name in `names` (an actor's); for a process
    an actor of `owners` started, "<actor> child" (a reward worker's reward process);
    else its own name (Ray's: raylet, gcs_server, ray::DashboardAgent, ...)."""
    if pid in names:
        return names[pid]
    try:
        process = psutil.Process(pid)
        for parent in process.parents():
            if parent.pid in (owners or {}):
                return f"{owners[parent.pid]} child"
        return _command_name(process.cmdline()) or process.name()
    except psutil.Error:
        return "gone"


def _command_name(command: list[str]) -> str:
    """Returns a command's program, or for a Python interpreter the script or module it
    runs (Ray's log_monitor.py, monitor.py; the local Ray's watchdog)."""
    if not command:
        return ""
    program = Path(command[0].split()[0]).name
    if not program.startswith("python"):
        return program
    arguments = [arg for arg in command[1:] if not arg.startswith("-") or arg == "-m"]
    if arguments[:1] == ["-m"] and len(arguments) > 1:
        return arguments[1]
    return Path(arguments[0]).name if arguments else program


def by_label(
    sizes: dict[int, int], names: dict[int, str], owners: dict[int, str] | None = None
) -> dict[str, int]:
    """Returns the sizes summed by process label (process_label), largest first."""
    totals: dict[str, int] = {}
    for pid, size in sizes.items():
        label = process_label(pid, names, owners)
        totals[label] = totals.get(label, 0) + size
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


class MemoryMonitor:
    """Follows the run's total PSS on a thread; keeps the last and the peak, and at the
    peak each process's share. `roots` returns the processes to follow (called at every
    look, so actors that start later are followed); `names` names some of them (the
    driver, the actors), the rest go by their own names.

    PSS costs the kernel a walk of every mapping of every process (CPU time taken from
    cores the run needs), so every `interval_s` the monitor reads only
    the summed resident set size, and measures PSS when that sum is 1% above the largest
    it was at a measurement, or `refresh_s` after the last. A peak in PSS is a peak in
    resident memory too, so it is caught unless the run's resident total stayed within
    1% of an earlier high and a later refresh also missed it."""

    def __init__(
        self,
        roots: Callable[[], Iterable[int]],
        interval_s: float = 1.0,
        names: Callable[[], dict[int, str]] = dict,
        refresh_s: float = 10.0,
    ):
        self.roots = roots
        self.names = names
        self.interval_s = interval_s
        self.refresh_s = refresh_s
        self.last_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.peak_by_process: dict[str, int] = {}
        """Each process's PSS (summed by label) in the sample of the peak."""
        self.samples = 0
        """PSS measurements made."""
        self._measured_rss = 0  # the largest resident total at a PSS measurement
        self._measured_at = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-monitor", daemon=True)

    def start(self) -> MemoryMonitor:
        self._thread.start()
        return self

    def sample(self) -> int | None:
        """Measures PSS now; returns the total in bytes."""
        self.samples += 1
        self._measured_at = time.monotonic()
        sizes = pss_by_process({os.getpid(), *self.roots()})
        if not sizes:
            return None
        total = sum(sizes.values())
        self.last_bytes = total
        if total > (self.peak_bytes or 0):
            self.peak_bytes = total
            actors = self.names()
            self.peak_by_process = by_label(sizes, {os.getpid(): "driver", **actors}, actors)
        return total

    def look(self) -> None:
        """Measures PSS if resident memory has grown past its last measured high or the
        last measurement is `refresh_s` old."""
        pids = with_descendants({os.getpid(), *self.roots()})
        resident = sum(filter(None, map(rss_bytes, pids)))
        grown = resident > self._measured_rss * 1.01
        if grown or time.monotonic() - self._measured_at >= self.refresh_s:
            self._measured_rss = max(self._measured_rss, resident)
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.look()
            self._stop.wait(self.interval_s)


def gib(size: int | None) -> float | None:
    return None if size is None else size / GIB
