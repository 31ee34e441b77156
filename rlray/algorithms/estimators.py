"""Advantage estimators, by name: what algorithm.advantage chooses.

An estimator turns a step's rewards into per-token advantages (and, with a critic, the
critic's targets). Adding one is a decorated function here and its test: the config's
choices, `--help`, and the checks (a critic to build, samples per prompt to compare)
all read this table. The math is in rl_math.py, tested against hand-worked values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlray.algorithms.lazy import rl_math as rm

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EstimatorInputs:
    """What advantages are computed from, for the B episodes of a step."""

    rewards: torch.Tensor  # (B, T) per-token rewards: the total at the last token, minus KL
    scores: torch.Tensor  # (B,) each episode's reward minus its KL penalty
    group: torch.Tensor  # (B,) long: index of the episode's group (its prompt)
    sample: torch.Tensor  # (B,) long: index of its sample (an agent trace's episodes: one)
    mask: torch.Tensor  # (B, T) 1.0 on the policy's completion tokens
    values: torch.Tensor | None  # (B, T) the critic's, for estimators that need one
    gamma: float
    lam: float
    whiten: bool


Advantages = tuple["torch.Tensor", "torch.Tensor | None"]
"""(B, T) advantages and, with a critic, its (B, T) targets."""


@dataclass(frozen=True)
class Estimator:
    name: str
    compute: Callable[[EstimatorInputs], Advantages]
    summary: str
    """One line on what it computes (--help shows it)."""
    needs_critic: bool = False
    compares_groups: bool = False
    """Whether it compares the samples of a prompt (rollout.samples_per_prompt >= 2)."""


ESTIMATORS: dict[str, Estimator] = {}


def estimator(
    name: str, *, needs_critic: bool = False, compares_groups: bool = False
) -> Callable[[Callable[[EstimatorInputs], Advantages]], Any]:
    """Registers the decorated function as the estimator `name`; its docstring's first
    line is its summary."""

    def register(compute: Callable[[EstimatorInputs], Advantages]) -> Any:
        summary = (compute.__doc__ or "").strip().splitlines()[0]
        ESTIMATORS[name] = Estimator(name, compute, summary, needs_critic, compares_groups)
        return compute

    return register


@estimator("gae", needs_critic=True)
def gae(x: EstimatorInputs) -> Advantages:
    """GAE over per-token rewards with a critic (PPO); whitened unless told not to."""
    if x.values is None:
        raise ValueError("gae needs the critic's values")
    advantages, returns = rm.gae(x.rewards, x.values, x.mask, x.gamma, x.lam)
    return (rm.masked_whiten(advantages, x.mask) if x.whiten else advantages), returns


@estimator("grpo", compares_groups=True)
def grpo(x: EstimatorInputs) -> Advantages:
    """(r - group mean) / group std, on every token (GRPO)."""
    return rm.grpo_advantages(x.scores, x.group, sample=x.sample)[:, None] * x.mask, None


@estimator("dr_grpo", compares_groups=True)
def dr_grpo(x: EstimatorInputs) -> Advantages:
    """r - group mean (Dr. GRPO; pair it with seq_mean_token_sum_norm)."""
    return rm.dr_grpo_advantages(x.scores, x.group, x.sample)[:, None] * x.mask, None


@estimator("rloo", compares_groups=True)
def rloo(x: EstimatorInputs) -> Advantages:
    """r - mean of the group's other samples (REINFORCE leave-one-out)."""
    return rm.rloo_advantages(x.scores, x.group, x.sample)[:, None] * x.mask, None


@estimator("reinforce_pp")
def reinforce_pp(x: EstimatorInputs) -> Advantages:
    """the discounted reward-to-go, whitened over the batch (REINFORCE++)."""
    return rm.reinforce_pp_advantages(x.rewards, x.mask, x.gamma), None


@estimator("reinforce_pp_baseline", compares_groups=True)
def reinforce_pp_baseline(x: EstimatorInputs) -> Advantages:
    """r - group mean, whitened over the batch (REINFORCE++ with a baseline)."""
    return rm.reinforce_pp_baseline_advantages(x.scores, x.group, x.mask, x.sample), None
