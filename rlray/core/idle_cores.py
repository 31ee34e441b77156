"""IdleCores: the CPU cores that a node's rollout workers hold but leave idle, lent to the
learner on the same node while they are idle.

On CPU each role reserves its own cores, and each keeps them whether it works or not:
a rollout worker generates the next batch in part of a learner step and then waits for
the weights, its cores idle while the learner trains on one. Here every CPU rollout
worker says, in a file of a node-local folder, whether it is generating and how many
cores it holds; a learner on that node reads the folder before each micro-batch and
trains with its own threads plus the idle workers' cores (Engine's `threads`). When a
worker starts generating again it takes its cores back at the learner's next
micro-batch, so the two share a core for at most one micro-batch.

A file is a few bytes rewritten in place (no lock: a reader sees the old state or the
new one, and either is safe). A worker that dies leaves its file "busy" or "idle": busy
costs the learner nothing but the loan; a dead worker's idle cores are idle. The
folder is the run's, under the node's shared memory (or temporary) folder, and the
driver removes it at the end (`remove`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_SHARED_MEMORY = Path("/dev/shm")


def board_folder(run_id: str) -> Path:
    """Returns the node-local folder where a run's rollout workers post their state."""
    root = _SHARED_MEMORY if _SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    return root / f"rlray-{run_id}-cores"


class CoreLender:
    """A rollout worker's side: it posts that it holds `cores` cores, idle except while
    one of its calls generates (calls may overlap: in-flight updates, agents' calls)."""

    def __init__(self, run_id: str, worker: str, cores: int):
        self.path = board_folder(run_id) / worker
        self.cores = cores
        self._generating = 0
        self._lock = threading.Lock()
        self._post(busy=False)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Takes the cores back for the block (generation), then lends them again."""
        with self._lock:
            self._generating += 1
            if self._generating == 1:
                self._post(busy=True)
        try:
            yield
        finally:
            with self._lock:
                self._generating -= 1
                if self._generating == 0:
                    self._post(busy=False)

    def _post(self, busy: bool) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            # time.monotonic is the node's one clock (CLOCK_MONOTONIC), in every process
            post = f"{int(busy)} {self.cores:4d} {time.monotonic():18.6f}"
            os.pwrite(descriptor, post.encode(), 0)
        finally:
            os.close(descriptor)


class IdleCores:
    """The learner's side: how many cores its node's rollout workers lend now."""

    def __init__(self, run_id: str):
        self.folder = board_folder(run_id)

    def idle(self, since: float = 0.0) -> int:
        """Returns how many cores this node's rollout workers hold and leave idle now,
        counting only workers idle since `since` (time.monotonic): a worker idle since
        before the learner last sent weights loads them and generates next."""
        total = 0
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            return 0
        for entry in entries:
            with contextlib.suppress(OSError, ValueError):
                busy, cores, posted = Path(entry.path).read_bytes().split()
                if busy == b"0" and float(posted) > since:
                    total += int(cores)
        return total

    def remove(self) -> None:
        """Removes the run's board from this node (the run's end)."""
        shutil.rmtree(self.folder, ignore_errors=True)
