"""Where a run's wall time goes: the driver's time split by what it waited on.

The driver is the run's critical path: whatever it waits on bounds the run. Each
learner step's wall time is split into the phases below; `other` is the rest (the
driver's own work: starting remote calls, bookkeeping, logging), so the phases of a
step add up to its wall time. Work that overlaps the wait (generation running while
the learner trains, with buffer.max_staleness >= 1) costs nothing here, which is the
point: it is off the critical path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = (
    "generation",  # waiting for a rollout batch to be generated
    "scoring",  # every batch generated, waiting for rewards
    "buffer",  # buffer calls: reserve, add, take, stats
    "training",  # waiting for the learner's step
    "weight_sync",  # publishing weights and loading them on every rollout worker
    "parity_check",  # after a sync: an engine and the learner score a few episodes
    "evaluation",  # held-out accuracy
    "checkpoint",  # saving a checkpoint
    "store",  # handing batches to the episode store and checking its answers
)


class PhaseClock:
    """Adds up wall seconds per phase; `lap` returns them with the wall time since the
    last lap and starts the next one."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Forgets everything counted so far; the first lap starts now."""
        self.totals = dict.fromkeys((*PHASES, "other", "total"), 0.0)
        self._lap = dict.fromkeys(PHASES, 0.0)
        self._lap_started = time.perf_counter()
        self._in_phase: str | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Counts the wall time of the block as `name`. Phases do not nest: time counted
        twice would make the split add up to more than the wall time."""
        if self._in_phase is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._in_phase!r}")
        self._in_phase = name
        started = time.perf_counter()
        try:
            yield
        finally:
            self._in_phase = None
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        if name not in self._lap:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        self._lap[name] += seconds

    def lap(self) -> dict[str, float]:
        """Returns {phase: seconds, "other": rest, "total": wall} since the last lap."""
        now = time.perf_counter()
        split = dict(self._lap)
        split["total"] = now - self._lap_started
        split["other"] = max(0.0, split["total"] - sum(self._lap.values()))
        for name, seconds in split.items():
            self.totals[name] += seconds
        self._lap = dict.fromkeys(PHASES, 0.0)
        self._lap_started = now
        return split


def describe_totals(totals: dict[str, float]) -> str:
    """Returns e.g. "training 61 s (48%), generation 40 s (31%), ..." largest first."""
    wall = totals.get("total", 0.0)
    parts = sorted(
        ((name, seconds) for name, seconds in totals.items() if name != "total"),
        key=lambda item: -item[1],
    )
    return ", ".join(
        f"{name} {seconds:.0f} s ({100 * seconds / wall:.0f}%)" if wall else f"{name} 0 s"
        for name, seconds in parts
        if seconds >= 0.5 or name in ("training", "generation")
    )
