"""A run's memory: the proportional set size (PSS) of its processes on the driver's node.

PSS charges each page shared by n processes 1/n to each, so the sum over processes
counts shared pages (torch's and vLLM's libraries, Ray's object store mappings) once,
where a sum of RSS would count them once per process. The run's processes are the
driver and everything it started (with a Ray of its own: Ray's processes and every
actor), plus the run's actors on this node and their children when it joined a cluster.
Linux only (`/proc/<pid>/smaps_rollup`); elsewhere the figures are None.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

GIB = 1024**3


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
    sizes = [pss_bytes(pid) for pid in with_descendants(pids)]
    known = [size for size in sizes if size is not None]
    return sum(known) if known else None


class MemoryMonitor:
    """Samples the run's total PSS every `interval_s` on a thread; keeps the last and the
    peak. `roots` returns the processes to follow (called at every sample, so actors
    that start later are followed)."""

    def __init__(self, roots: Callable[[], Iterable[int]], interval_s: float = 1.0):
        self.roots = roots
        self.interval_s = interval_s
        self.last_bytes: int | None = None
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-monitor", daemon=True)

    def start(self) -> MemoryMonitor:
        self._thread.start()
        return self

    def sample(self) -> int | None:
        """Measures now; returns the total PSS in bytes."""
        total = total_pss_bytes({os.getpid(), *self.roots()})
        if total is not None:
            self.last_bytes = total
            self.peak_bytes = max(total, self.peak_bytes or 0)
        return total

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)


def gib(size: int | None) -> float | None:
    return None if size is None else size / GIB
