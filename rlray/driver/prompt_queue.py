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

    def next_batch(self, size: int) -> tuple[int, int]:
        """Returns (first prompt index, count) of the next batch of at most `size`
        prompts, without handing it out: the next run of consecutive prompts to replay,
        else `size` prompts from the cursor."""
        if not self.replay:
            return self.cursor, size
        first, count = self.replay[0], 1
        while count < min(size, len(self.replay)) and self.replay[count] == first + count:
            count += 1
        return first, count

    def hand_out(self, first: int, count: int) -> None:
        """Marks the batch `next_batch` returned as handed out."""
        if self.replay and self.replay[0] == first:
            for _ in range(count):
                self.replay.popleft()
        else:
            self.cursor = first + count
