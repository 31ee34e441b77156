"""EpisodeBuffer: a bounded FIFO of references to scored episode batches.

The buffer never looks inside a batch: it holds an opaque reference (a Ray ObjectRef
wrapped in a list so Ray does not resolve it) plus the few numbers it needs to apply
backpressure and the staleness rule. The learner resolves the references itself.

A learner step never takes more than the episodes it asks for where a batch says how
its groups are sized: an agent batch, whose traces make a model call's episode each
(rollout batches are sized to the step and taken whole). One that would overfill a
step is split between its groups: the step takes the groups that fit, the rest stay at the
buffer's head for the next step (or are dropped at once, stored untrained, where the
next step would find them stale), and each part's reference names its groups,
`[ref, start, stop]` (rlray.cluster.calls.resolve_episodes reads them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class BufferedBatch:
    """A reference to one scored rollout batch and what the buffer needs to know of it."""

    ref: Any
    policy_version: int
    num_episodes: int
    first_prompt_index: int
    batch_id: int
    external: bool = False
    """Posted to the ingestion endpoint: off-policy by design, never dropped as stale."""
    group_sizes: list[int] = field(default_factory=list)
    """Episodes of each of its groups, in order (an agent batch's); empty: the batch is
    never split."""
    group_prompts: list[int] = field(default_factory=list)
    """The prompt index of each of its groups (the driver's checkpoints name them)."""

    def split(self, room: int, at_least_one: bool) -> tuple[BufferedBatch | None, BufferedBatch]:
        """Returns (its first groups that total at most `room` episodes, or its first group
        alone if `at_least_one` and even that one does not fit; None if no group is
        taken, the rest)."""
        taken, count = 0, 0
        while taken < len(self.group_sizes) and count + self.group_sizes[taken] <= room:
            count += self.group_sizes[taken]
            taken += 1
        if taken == 0 and at_least_one and self.group_sizes:
            taken, count = 1, self.group_sizes[0]
        if taken == 0:
            return None, self
        start, stop = self.ref[1:] if len(self.ref) == 3 else (0, len(self.group_sizes))
        head = replace(self, ref=[self.ref[0], start, start + taken], num_episodes=count)
        head.group_sizes, head.group_prompts = self.group_sizes[:taken], self.group_prompts[:taken]
        rest = replace(self, ref=[self.ref[0], start + taken, stop])
        rest.num_episodes, rest.group_sizes = self.num_episodes - count, self.group_sizes[taken:]
        rest.group_prompts = self.group_prompts[taken:]
        return head, rest


@dataclass
class TakenBatches:
    """What one take returns: fresh batches for a learner step, and what was dropped."""

    batches: list[BufferedBatch]
    dropped: list[BufferedBatch]
    depth_episodes: int = 0
    """Episodes the buffer holds after the take."""
    dropped_stale_episodes: int = 0
    """Episodes dropped as stale so far, in all."""
    rest: BufferedBatch | None = None
    """What the buffer still holds of a batch this take split (the last of `batches` is
    its first part)."""


class EpisodeBuffer:
    """Holds at most `capacity_episodes`; drops batches more than `max_staleness` versions
    behind the learner when the learner asks for data."""

    def __init__(self, capacity_episodes: int, max_staleness: int):
        self.capacity_episodes = capacity_episodes
        self.max_staleness = max_staleness
        self._batches: deque[BufferedBatch] = deque()
        self.depth_episodes = 0
        self.reserved_episodes = 0
        self.dropped_stale_episodes = 0
        self.added_episodes = 0
        self._dropped_unreported: list[BufferedBatch] = []

    def reserve(self, num_episodes: int) -> bool:
        """Reserves room for a batch about to be generated; returns False (the producer
        waits) when held plus reserved episodes would exceed the capacity. Reserving
        before generating keeps in-flight episodes inside the bound too."""
        if self.depth_episodes + self.reserved_episodes + num_episodes > self.capacity_episodes:
            return False
        self.reserved_episodes += num_episodes
        return True

    def reserve_batches(self, sizes: list[int]) -> int:
        """Reserves room for batches about to be generated, in order, while each fits;
        returns how many were reserved (the producer starts those, and waits with the
        rest): one call for every idle producer."""
        for reserved, size in enumerate(sizes):
            if not self.reserve(size):
                return reserved
        return len(sizes)

    def add(self, batch: BufferedBatch, reserved: int | None = None) -> None:
        """Appends a batch whose room was reserved and gives back the whole reservation
        (`reserved` episodes, default the batch's size: dynamic sampling may leave fewer,
        or none, of a reserved batch; agents' traces, one reserved each, may make more,
        a model call each, and the buffer then holds more than its capacity until the
        learner's next step); raises if more was given back than reserved."""
        reserved = batch.num_episodes if reserved is None else reserved
        if self.reserved_episodes < reserved:
            raise OverflowError(
                f"add of {batch.num_episodes} episodes against a reservation of {reserved} "
                f"({self.reserved_episodes} reserved in all)"
            )
        self.reserved_episodes -= reserved
        if batch.num_episodes == 0:
            return
        self._batches.append(batch)
        self.depth_episodes += batch.num_episodes
        self.added_episodes += batch.num_episodes

    def add_batches(self, batches: list[tuple[BufferedBatch, int]]) -> None:
        """Appends, in order, batches whose room was reserved, each with its reservation
        (see `add`): every batch a producer has ready, in one call."""
        for batch, reserved in batches:
            self.add(batch, reserved)

    def is_stale(self, batch: BufferedBatch, learner_version: int) -> bool:
        """Returns whether the batch's policy is more than max_staleness versions behind."""
        return not batch.external and learner_version - batch.policy_version > self.max_staleness

    def take(self, num_episodes: int, learner_version: int) -> TakenBatches | None:
        """Drops stale batches, then removes and returns the oldest fresh batches, at most
        `num_episodes` in all: a batch with group sizes that does not fit is split between
        its groups (a first group bigger than the step is taken alone), and what is left
        of it is dropped now if the next step would find it stale. Returns with them
        every batch dropped since the last take; None while fewer fresh episodes are
        here."""
        self._drop_stale(learner_version)
        if self.depth_episodes < num_episodes:
            return None
        count, batches, rest = 0, [], None
        while self._batches and count < num_episodes:
            batch = self._batches[0]
            if count + batch.num_episodes <= num_episodes or not batch.group_sizes:
                batches.append(self._batches.popleft())  # whole, as rollout batches are
                count += batch.num_episodes
                continue
            head, remaining = batch.split(num_episodes - count, at_least_one=not batches)
            if head is not None:
                self._batches[0] = rest = remaining
                batches.append(head)
                count += head.num_episodes
            break
        self.depth_episodes -= count
        if rest is not None and self.is_stale(rest, learner_version + 1):
            # The next step would find it stale: dropped now (stored, never trained), so
            # that this take reports it and the producer's count stays true.
            self._drop(self._batches.popleft())
            rest = None
        dropped, self._dropped_unreported = self._dropped_unreported, []
        taken = TakenBatches(batches, dropped, self.depth_episodes, self.dropped_stale_episodes)
        taken.rest = rest
        return taken

    def _drop_stale(self, learner_version: int) -> None:
        kept: deque[BufferedBatch] = deque()
        for batch in self._batches:
            if self.is_stale(batch, learner_version):
                self._drop(batch)
            else:
                kept.append(batch)
        self._batches = kept

    def _drop(self, batch: BufferedBatch) -> None:
        self._dropped_unreported.append(batch)
        self.depth_episodes -= batch.num_episodes
        self.dropped_stale_episodes += batch.num_episodes

    def restore(self, batches: list[BufferedBatch], reserved_episodes: int) -> None:
        """Refills a buffer that was restarted empty with what its producer knows it held
        (batches added and not yet taken, in order) and had reserved."""
        if self._batches or self.reserved_episodes:
            raise RuntimeError("restore is for an empty, freshly started buffer")
        self._batches = deque(batches)
        self.depth_episodes = sum(b.num_episodes for b in batches)
        self.added_episodes = self.depth_episodes
        self.reserved_episodes = reserved_episodes

    def drain(self) -> list[BufferedBatch]:
        """Removes and returns every held batch (the end of a run: they go to the store
        untrained)."""
        batches, self._batches = list(self._batches), deque()
        self.depth_episodes = 0
        return batches

    def oldest_prompt_index(self) -> int | None:
        """Returns the first prompt index of the oldest held batch of this run's prompts,
        or None if there is none."""
        indexes = (b.first_prompt_index for b in self._batches if not b.external)
        return min(indexes, default=None)

    def stats(self) -> dict[str, int]:
        """Returns depth, capacity and counters (small; goes into metrics)."""
        return {
            "buffer_depth": self.depth_episodes,
            "buffer_reserved": self.reserved_episodes,
            "buffer_capacity": self.capacity_episodes,
            "dropped_stale": self.dropped_stale_episodes,
            "added": self.added_episodes,
        }
