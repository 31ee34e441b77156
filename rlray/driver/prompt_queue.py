"""The order in which a training run hands out prompts: a resumed run's unfinished
prompts first, then the stream from its cursor.

A checkpoint records the cursor (the first prompt never handed out) and the prompts
handed out and not yet trained on: those in flight, carried in an engine by partial
rollouts, buffered, or in a learner step under way. A resumed run regenerates exactly
those, in contiguous runs (a batch is a run of consecutive prompt indices), and then
goes on from the cursor: no prompt is trained twice, none is skipped.
"""

from __future__ import annotations

from collections import deque


class PromptQueue:
    """Hands out prompt indices in batches of consecutive ones."""

    def __init__(self, cursor: int, replay: list[int] | None = None):
        self.cursor = cursor
        """The first prompt of the stream never handed out."""
        self.replay = deque(sorted(replay or []))
        """Prompts a checkpoint left unfinished, regenerated before the stream goes on."""

    def next_batches(self, size: int, count: int) -> list[tuple[int, int]]:
        """Returns (first prompt index, prompts) of the next `count` batches of at most
        `size` prompts each, without handing them out: runs of consecutive prompts to
        replay, then `size` prompts at a time from the cursor. Handed out in this order,
        they are the batches that would have been returned one at a time."""
        batches = []
        replayed, cursor = 0, self.cursor
        while len(batches) < count:
            if replayed < len(self.replay):
                first, prompts = self.replay[replayed], 1
                while (
                    prompts < size
                    and replayed + prompts < len(self.replay)
                    and self.replay[replayed + prompts] == first + prompts
                ):
                    prompts += 1
                replayed += prompts
            else:
                first, prompts = cursor, size
                cursor += size
            batches.append((first, prompts))
        return batches

    def hand_out(self, first: int, count: int) -> None:
        """Marks the first batch `next_batches` returned as handed out."""
        if self.replay and self.replay[0] == first:
            for _ in range(count):
                self.replay.popleft()
        else:
            self.cursor = first + count
