"""The environment protocol of multi-turn rollouts (the loop in rlray.rollout.multiturn
drives it; one instance per trajectory).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rlray.core.episode import Span

T = TypeVar("T")


@dataclass
class StepResult:
    """What an environment answers to one model turn."""

    observation: str
    """Text appended after the turn (in the model's chat format); ignored when done."""
    reward: float | None
    """This turn's reward, or None when the turn earns none."""
    done: bool
    """Whether the episode ends with this turn."""


class Environment(Protocol):
    """One trajectory's environment; reset and step may also be `async def`."""

    def reset(self, row: Any) -> str | Awaitable[str]:
        """Returns the first observation for the dataset row (a PromptRow)."""
        ...

    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Returns the answer to the model's turn `action`."""
        ...


async def maybe_await(value: T | Awaitable[T]) -> T:
    """Returns value, awaited first if it is awaitable: `await maybe_await(env.step(text))`
    steps a plain and an async environment alike."""
    return await value if inspect.isawaitable(value) else value


def take_spans(environment: Any) -> list[Span]:
    """Returns the spans the environment recorded since the last call ([] if it keeps none)."""
    take = getattr(environment, "take_spans", None)
    return take() if take is not None else []


def row_columns(row: Any) -> dict[str, Any]:
    """Returns the dataset columns of a PromptRow (or of a plain dict of columns)."""
    return row.columns if hasattr(row, "columns") else dict(row)
