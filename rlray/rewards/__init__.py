"""Reward functions and the RewardWorker that applies them to episode batches.

A reward function scores a batch the way TRL's GRPOTrainer expects:
`f(prompts, completions, **columns) -> list[float | None]`, where each dataset column
(e.g. `answer`) arrives as a list aligned with the prompts.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.config import ConfigError, RewardSpec
from rlray.episode import Episode

RewardFn = Callable[..., list[float | None]]


def exact_match(
    prompts: list[str], completions: list[str], answer: list[str], **_: Any
) -> list[float]:
    """Returns 1.0 where the completion, stripped of surrounding white space, equals the
    answer, else 0.0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match}


@dataclass
class WeightedReward:
    """A reward function with its weight and fixed keyword arguments."""

    name: str
    fn: RewardFn
    weight: float
    kwargs: dict[str, Any] = field(default_factory=dict)


def load_rewards(specs: list[RewardSpec]) -> list[WeightedReward]:
    """Returns the configured reward functions, or raises ConfigError naming a bad one."""
    rewards = []
    for i, spec in enumerate(specs):
        fn = BUILTIN_REWARDS.get(spec.name)
        if fn is None:
            known = ", ".join(sorted(BUILTIN_REWARDS))
            raise ConfigError(
                f"reward.functions[{i}].name: unknown reward {spec.name!r}; built-ins: {known}"
            )
        try:
            inspect.signature(fn).bind_partial(["p"], ["c"], **spec.kwargs)
        except TypeError as err:
            raise ConfigError(f"reward.functions[{i}] ({spec.name}): {err}") from None
        rewards.append(WeightedReward(spec.name, fn, spec.weight, dict(spec.kwargs)))
    return rewards


@dataclass
class ScoreStats:
    """Small summary of one scoring call, sent to the driver instead of the episodes."""

    worker: str
    episodes: int
    reward_sum: float
    seconds: float


class RewardWorker:
    """Scores episode batches: sets each episode's total and per-component rewards."""

    def __init__(self, name: str, specs: list[RewardSpec]):
        self.name = name
        self.rewards = load_rewards(specs)

    def score(self, episodes: list[Episode]) -> tuple[list[Episode], ScoreStats]:
        """Returns the episodes with rewards set, and a stats record."""
        started = time.perf_counter()
        prompts = [e.prompt for e in episodes]
        completions = [e.completion for e in episodes]
        columns = {key: [e.columns.get(key) for e in episodes] for key in _column_names(episodes)}
        totals = [0.0] * len(episodes)
        for reward in self.rewards:
            scores = reward.fn(prompts, completions, **columns, **reward.kwargs)
            if len(scores) != len(episodes):
                got, want = len(scores), len(episodes)
                raise ValueError(f"reward {reward.name} returned {got} scores for {want} episodes")
            for i, score in enumerate(scores):
                value = None if score is None or math.isnan(score) else float(score)
                episodes[i].reward_components[reward.name] = value
                totals[i] += reward.weight * (value or 0.0)
        now = time.time()
        for episode, total in zip(episodes, totals, strict=True):
            episode.reward = total
            episode.scored_at = now
        stats = ScoreStats(self.name, len(episodes), sum(totals), time.perf_counter() - started)
        return episodes, stats


def _column_names(episodes: list[Episode]) -> list[str]:
    names: dict[str, None] = {}
    for episode in episodes:
        names.update(dict.fromkeys(episode.columns))
    return list(names)
