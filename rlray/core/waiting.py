"""Long waits that say what they are doing: a countdown printed while a wait lasts (a
built-in model's first-use build, the actors' start-up), its estimate the duration the
same wait last took on this machine, else a first guess.

    with timed_wait("building tiny-arithmetic", "build tiny-arithmetic", waits, 120):
        build()

prints nothing for a wait shorter than `every_s`, then every `every_s` seconds
"building tiny-arithmetic: ~1m40s left", or, past the estimate, "building
tiny-arithmetic: taking longer than expected, 2m10s so far"; and records how long it
took for the next time.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

WAITS_FILE = "wait-durations.json"
"""The file, in a cache folder, that keeps how long each wait last took."""


def duration(seconds: float) -> str:
    """Returns `seconds` as "42s" or "3m07s"."""
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Countdown:
    """Prints, every `every_s` seconds from start() until stop(), how long the wait for
    `what` has left by its estimate, or that it overran it: a wait that ends within
    `every_s` prints nothing. The lines come from a thread of their own, so the waiting
    code needs no change."""

    def __init__(
        self,
        what: str,
        estimate_s: float,
        out: TextIO | None = None,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what = what
        self.estimate_s = estimate_s
        self.out = out
        """Where the lines go; sys.stdout (as it is when a line is printed) if None."""
        self.every_s = every_s
        self.clock = clock
        self.started: float | None = None
        self.ended: float | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Countdown:
        """Starts the clock and the thread that prints; returns self."""
        self.started, self.ended = self.clock(), None
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="countdown", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stops printing (no line comes after it returns); returns the seconds from
        start() to now."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.started is not None and self.ended is None:
            self.ended = self.clock()
        return self.elapsed()

    def elapsed(self) -> float:
        """Returns the seconds from start() to stop(), or to now while it runs (0 before
        start())."""
        if self.started is None:
            return 0.0
        return (self.clock() if self.ended is None else self.ended) - self.started

    def line(self) -> str:
        """Returns what the countdown says now."""
        elapsed = self.elapsed()
        left = self.estimate_s - elapsed
        if left >= 1:
            return f"{self.what}: ~{duration(left)} left"
        return f"{self.what}: taking longer than expected, {duration(elapsed)} so far"

    def tick(self) -> None:
        """Prints the line for now."""
        print(self.line(), file=sys.stdout if self.out is None else self.out, flush=True)

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            self.tick()

    def __enter__(self) -> Countdown:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Durations:
    """How long each named wait last took on this machine, in seconds, kept in a JSON
    file. A file that cannot be read or written is as good as none: a countdown never
    stops the work it describes."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def in_folder(cls, folder: Path) -> Durations:
        """Returns the durations kept in `folder` (a cache folder)."""
        return cls(folder / WAITS_FILE)

    def _read(self) -> dict[str, float]:
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def last(self, key: str) -> float | None:
        """Returns how long the wait `key` last took, None if it has not been measured."""
        seconds = self._read().get(key)
        return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else None

    def record(self, key: str, seconds: float) -> None:
        """Keeps `seconds` as the wait `key`'s last duration. Processes that record at
        once may lose one of theirs (the file is replaced whole, never torn)."""
        found = {**self._read(), key: round(seconds, 1)}
        temporary = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".waits-")
            with os.fdopen(handle, "w") as out:
                json.dump(found, out, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except OSError:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)


@contextlib.contextmanager
def timed_wait(
    what: str,
    key: str,
    durations: Durations,
    default_s: float,
    out: TextIO | None = None,
    every_s: float = 10.0,
) -> Iterator[Countdown]:
    """Runs the block under a Countdown for `what`, its estimate how long the wait `key`
    last took (else `default_s`); records the block's duration under `key` if it ends
    without an error (a failed wait says nothing of the next one)."""
    last = durations.last(key)
    countdown = Countdown(what, default_s if last is None else last, out, every_s)
    with countdown:
        yield countdown
    durations.record(key, countdown.elapsed())
