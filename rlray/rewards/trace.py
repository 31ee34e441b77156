"""Built-in rewards read from an episode's trace (its spans), for multi-turn episodes.

The reward worker passes each episode's spans (rlray.episode.Span) as the `spans` column
to rewards that name it.
"""

from __future__ import annotations

from typing import Any

from rlray.episode import Span


def environment_reward(
    completions: list[Any], spans: list[list[Span]], **kwargs: Any
) -> list[float | None]:
    """Returns the sum of the rewards each episode's environment gave (per turn or at
    the end), or None for an episode it gave none (that component fails for it)."""
    return [_environment_total(trace) for trace in spans]


def _environment_total(trace: list[Span]) -> float | None:
    values = [s.value for s in trace if s.kind == "reward" and s.source == "environment"]
    return sum(values) if values else None
