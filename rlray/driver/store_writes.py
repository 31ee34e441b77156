"""Writes to the episode store, kept until the store confirms them.

The store fetches each batch from the object store itself; the driver sends only
references. A write is kept until the store answers for it, and sent again, under the
same key, if the store dies first: the store recognises the key and stores it once.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rlray.cluster.calls import ActorFailure, wait_for
from rlray.core.interrupts import interrupts_held
from rlray.core.stats import StoreStats
from rlray.driver.recovery import Recovery
from rlray.observe.timing import PhaseClock

logger = logging.getLogger(__name__)


@dataclass
class StoreWrite:
    """Batches sent to the store and not yet confirmed; resent (same key) if it dies."""

    batch_refs: list[list[Any]]
    trained_at: float | None
    ref: Any = None


class StoreWrites:
    """The run's writes to its `store` actor, each confirmed or sent again."""

    def __init__(self, store: Any, recovery: Recovery, clock: PhaseClock):
        self.store = store
        self.recovery = recovery
        self.clock = clock
        self.pending: dict[str, StoreWrite] = {}
        """Writes sent and not yet confirmed, by key."""
        recovery.restorers["store"] = self._send_again

    def write(self, batch_refs: list[list[Any]], trained_at: float | None) -> None:
        """Sends batches ([ref] each; trained_at None: never trained on) to the store;
        its answers are checked later, without holding up the caller."""
        with self.clock.phase("store"), interrupts_held():
            if batch_refs:
                key = uuid.uuid4().hex
                self.pending[key] = StoreWrite(batch_refs, trained_at)
                self.submit(key, self.pending[key])
            self.confirm(block=False)

    def submit(self, key: str, write: StoreWrite) -> None:
        write.ref = self.store.append_batches.remote(
            write.batch_refs, write.trained_at, self.recovery.timeout_s, key
        )

    def confirm(self, block: bool) -> None:
        """Forgets the writes the store confirmed (all of them, waiting, if `block`);
        a dead store is waited for and gets every unconfirmed write again."""
        writes = list(self.pending.items())
        if not block and writes:
            done, _ = ray.wait([w.ref for _, w in writes], num_returns=len(writes), timeout=0)
            writes = [(key, w) for key, w in writes if w.ref in set(done)]
        for key, write in writes:
            try:
                wait_for(write.ref, "store", "append", self.recovery.timeout_s)
            except ActorFailure as err:
                # Batches lost with their node cannot be sent again: the run resumes from
                # its checkpoint, which hands their prompts out again.
                if err.lost or not err.died:
                    raise
                self.recovery.recover("store", err)  # sends every unconfirmed write again
                return self.confirm(block)
            del self.pending[key]
        return None

    def _send_again(self, name: str) -> None:
        for key, write in self.pending.items():
            self.submit(key, write)

    def close(self, upload_timeout_s: float) -> StoreStats | None:
        """Waits for every write, closes the store (its buffered rows written, uploads
        waited for) and returns its stats; None if it could not be closed (logged)."""
        try:
            self.confirm(block=True)
            timeout = self.recovery.timeout_s + upload_timeout_s
            stats, spooled = wait_for(self.store.close.remote(), "store", "close", timeout)
        except ActorFailure as err:
            logger.warning("episodes not yet written may be lost: %s", err)
            return None
        if spooled:
            logger.warning(
                "%d episode file(s) not uploaded; they wait in %s",
                len(spooled),
                Path(spooled[0]).parent,
            )
        return stats
