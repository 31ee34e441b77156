"""Built-in rewards read from an episode's trace (its spans), for multi-turn episodes.

The reward worker passes each episode's spans (rlray.core.episode.Span) as the `spans` column
to rewards that name it.
"""

from __future__ import annotations

from typing import Any

from rlray.core.episode import Span


def environment_reward(
    completions: list[Any], spans: list[list[Span]], **kwargs: Any
) -> list[float | None]:
    """Returns the sum of the rewards each episode's environment gave (per turn or at
    the end), or None for an episode it gave none (that component fails for it)."""
    return [environment_total(trace) for trace in spans]


def environment_total(trace: list[Span]) -> float | None:
    """Returns the sum of the rewards an environment gave in a trace, or None if it gave
    none."""
    values = [s.value for s in trace if s.kind == "reward" and s.source == "environment"]
    return sum(values) if values else None


def tool_success(
    prompts: list[str],
    completions: list[str],
    spans: list[list[Span | dict[str, Any]]] | None = None,
    *,
    no_calls: float = 0.0,
    **_: Any,
) -> list[float | None]:
    """Returns, per episode, the share of its tool_call spans without an error; `no_calls`
    for an episode that made none.

    Shaped like rlray's other rewards, plus `spans`: each episode's Episode.spans (Span
    objects or their dicts, as stored), aligned with the prompts."""
    if spans is None:
        raise ValueError("tool_success scores tool_call spans: pass spans=[episode.spans, ...]")
    return [_success_share(episode_spans, no_calls) for episode_spans in spans]


def _success_share(spans: list[Span | dict[str, Any]], no_calls: float) -> float:
    errors = [
        (span.get("error") if isinstance(span, dict) else span.error)
        for span in spans
        if (span.get("kind") if isinstance(span, dict) else span.kind) == "tool_call"
    ]
    if not errors:
        return no_calls
    return sum(error is None for error in errors) / len(errors)
