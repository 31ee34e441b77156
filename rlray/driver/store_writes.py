"""Writes to the episode store, kept until the store confirms them.

The store fetches each batch from the object store itself; the driver sends only
references. A write is kept until the store answers for it, and sent again, under the
same key, if the store dies first: the store recognises the key and stores it once.
With several shards (store.shards) the writes go to each in turn, and a write is sent
again to the shard it was sent to, the one whose journal knows its key.
"""

from __future__ import annotations

import itertools
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
    shard: str
    """The name of the store actor it goes to."""
    ref: Any = None


class StoreWrites:
    """The run's writes to its store actors (`stores`: name and handle of each shard),
    each confirmed or sent again."""

    def __init__(self, stores: list[tuple[str, Any]], recovery: Recovery, clock: PhaseClock):
        self.stores = dict(stores)
        self.turns = itertools.cycle(self.stores)
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
                self.pending[key] = StoreWrite(batch_refs, trained_at, next(self.turns))
                self.submit(key, self.pending[key])
            self.confirm(block=False)

    def submit(self, key: str, write: StoreWrite) -> None:
        write.ref = self.stores[write.shard].append_batches.remote(
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
                wait_for(write.ref, write.shard, "append", self.recovery.timeout_s)
            except ActorFailure as err:
                # Batches lost with their node cannot be sent again: the run resumes from
                # its checkpoint, which hands their prompts out again.
                if err.lost or not err.died:
                    raise
                self.recovery.recover(write.shard, err)  # sends its unconfirmed writes again
                return self.confirm(block)
            del self.pending[key]
        return None

    def _send_again(self, name: str) -> None:
        """Sends the restarted store actor `name` every write of its not yet confirmed."""
        for key, write in self.pending.items():
            if write.shard == name:
                self.submit(key, write)

    def close(self, upload_timeout_s: float) -> StoreStats | None:
        """Waits for every write, closes every shard of the store (its buffered rows
        written, uploads waited for) and returns their stats, summed; None if one could
        not be closed (logged)."""
        timeout = self.recovery.timeout_s + upload_timeout_s
        try:
            self.confirm(block=True)
            closing = [(name, store.close.remote()) for name, store in self.stores.items()]
            closed = [wait_for(ref, name, "close", timeout) for name, ref in closing]
        except ActorFailure as err:
            logger.warning("episodes not yet written may be lost: %s", err)
            return None
        stats = StoreStats.total([shard_stats for shard_stats, _ in closed])
        spooled = [path for _, paths in closed for path in paths]
        if spooled:
            spools = ", ".join(sorted({str(Path(path).parent) for path in spooled}))
            logger.warning("%d episode file(s) not uploaded; they wait in %s", len(spooled), spools)
        return stats
