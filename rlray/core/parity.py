"""A weight sync's check: the logprobs the learner gives a few episodes' tokens against
those a rollout engine holding the synced weights gives the same tokens.

The learner makes a `ParitySample` of its last step's episodes with the weights it has
just published; the engine scores the same tokens as a prompt once it has loaded them
and compares (`parity_gap`). A sync that corrupted a weight shows as a gap far above
float rounding. The comparison is made where the engine's numbers are, so the learner
may train on while a sync is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlray.core.episode import Episode


@dataclass
class ParitySample:
    """Episodes of the learner's last step and the learner's logprobs of their tokens."""

    episodes: list[Episode]
    learner_logprobs: list[list[float]]
    """The learner's logprob of each completion token (at temperature 1), per episode."""
    version: int
    """The learner version whose weights gave them."""


def parity_gap(sample: ParitySample, engine_logprobs: list[list[float]]) -> float | None:
    """Returns max |engine logprob - learner logprob| over the policy's tokens of the
    sample (completion_mask 1; every token when the mask is empty); None if it has none."""
    gaps = [
        abs(engine - learner)
        for episode, learner_row, engine_row in zip(
            sample.episodes, sample.learner_logprobs, engine_logprobs, strict=True
        )
        for engine, learner, policy in zip(
            engine_row, learner_row, episode.completion_mask or _all_policy(engine_row), strict=True
        )
        if policy
    ]
    return max(gaps, default=None)


def _all_policy(tokens: list[float]) -> list[int]:
    return [1] * len(tokens)
