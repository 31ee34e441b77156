"""Rewards: the built-in reward functions, loading rewards from config, and scoring.

A reward scores a batch the way TRL's GRPOTrainer expects:
`f(prompts, completions, **columns) -> list[float | None]`, where each dataset column
(e.g. `answer`) arrives as a list aligned with the prompts.

- `rlray.rewards.loading`: spec names (built-ins, import paths) to callables, schedules.
- `rlray.rewards.worker`: RewardWorker, which scores batches and survives faulty rewards.
- `rlray.rewards.text`, `.code`, `.model_based`, `.trace`: the built-ins (docs/rewards.md
  lists them).
"""

from rlray.core.stats import ScoreStats
from rlray.rewards.loading import (
    BUILTIN_REWARDS,
    LoadedReward,
    RewardFn,
    absolute_spec_path,
    check_rewards,
    load_reward,
    scheduled_weight,
)
from rlray.rewards.text import exact_match
from rlray.rewards.worker import RewardWorker

__all__ = [
    "BUILTIN_REWARDS",
    "LoadedReward",
    "RewardFn",
    "RewardWorker",
    "ScoreStats",
    "absolute_spec_path",
    "check_rewards",
    "exact_match",
    "load_reward",
    "scheduled_weight",
]
