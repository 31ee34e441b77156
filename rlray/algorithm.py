"""The algorithm: advantages and losses, as a small object built from numbers.

An `Algorithm` knows nothing of models, devices or Ray. Given a step's rewards, the
learner's logprobs (before the update), the reference's and the critic's values, it
returns advantages; given a micro-batch's fresh logprobs and values, it returns the
loss. The engine (rlray/engine.py) runs the forward passes and the optimizer; the
learner (rlray/learner.py) hands tensors from one to the other. Every formula lives in
rlray/rl_math.py.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields

import torch

from rlray import rl_math as rm
from rlray.config import AlgorithmConfig, PolicyLoss

# The usual clip offsets of each policy loss (low, high), used when the config leaves
# them unset: PPO's 0.2; GSPO's ratio is a per-token geometric mean, so it moves far
# less (the paper's 3e-4 / 4e-4); CISPO truncates its weight at 5 with no lower bound
# (ScaleRL, https://arxiv.org/abs/2510.13786).
DEFAULT_CLIPS: dict[str, tuple[float, float]] = {
    "ppo": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 4.0),
}
assert set(DEFAULT_CLIPS) == set(typing.get_args(PolicyLoss))

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


@dataclass
class StepInputs:
    """What advantages are computed from, for every episode of a step (B rows)."""

    rewards: torch.Tensor  # (B,) each episode's total reward
    group: torch.Tensor  # (B,) long: index of the episode's group (its prompt)
    mask: torch.Tensor  # (B, T) 1.0 on completion tokens
    old_logp: torch.Tensor  # (B, T) the learner's logprobs before the update
    ref_logp: torch.Tensor | None  # (B, T) the reference model's, if it is held
    values: torch.Tensor | None  # (B, T) the critic's, if the estimator needs one


@dataclass
class Advantages:
    """A step's advantages (B, T), and the critic's targets when it has one."""

    advantages: torch.Tensor
    returns: torch.Tensor | None
    kl: torch.Tensor | None  # (B, T) KL estimate against the reference, for metrics


@dataclass
class MicroBatch:
    """One micro-batch's rows: fresh outputs of the forward pass (with gradient) and the
    step's tensors for the same rows."""

    logp: torch.Tensor  # (b, T) with gradient
    mask: torch.Tensor  # (b, T) tokens that enter the loss
    old_logp: torch.Tensor  # (b, T)
    advantages: torch.Tensor  # (b, T)
    correction: torch.Tensor  # (b, T) rollout-correction weights
    entropy: torch.Tensor | None = None  # (b, T), with gradient when it enters the loss
    values: torch.Tensor | None = None  # (b, T) with gradient (critic)
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


@dataclass(frozen=True)
class Algorithm:
    """An advantage estimator, a policy loss and a loss aggregation, with their numbers."""

    advantage: str = "gae"
    policy_loss: str = "ppo"
    loss_aggregation: str = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    vf_coef: float = 0.5
    value_clip: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_mode: str = "reward"
    entropy_coef: float = 0.0
    mask_truncated: bool = False
    rollout_correction: str = "token"
    rollout_correction_clip: float = 2.0
    max_length: int = 1
    """Completion length limit (rollout.max_new_tokens): seq_mean_token_sum_norm's constant."""

    @classmethod
    def from_config(cls, config: AlgorithmConfig, max_new_tokens: int) -> Algorithm:
        """Returns the algorithm the config section describes (unset clips: the policy
        loss's own)."""
        numbers = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        low, high = DEFAULT_CLIPS[config.policy_loss]
        numbers["clip_low"] = low if config.clip_low is None else config.clip_low
        numbers["clip_high"] = high if config.clip_high is None else config.clip_high
        return cls(**numbers, max_length=max_new_tokens)

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_entropy_gradient(self) -> bool:
        return self.entropy_coef > 0

    @property
    def compares_groups(self) -> bool:
        """Whether advantages compare the samples of a prompt (uniform groups teach nothing)."""
        return self.advantage in GROUP_ESTIMATORS

    # ------------------------------------------------------------------ advantages

    def advantages(self, step: StepInputs) -> Advantages:
        """Returns the step's advantages (and critic targets), KL-in-reward included."""
        mask = step.mask
        kl = None
        if step.ref_logp is not None:
            kl = rm.kl_estimate(step.old_logp, step.ref_logp, self.kl_estimator)
        reward_kl = self.kl_coef if self.kl_mode == "reward" and kl is not None else 0.0
        zero_kl = torch.zeros_like(mask) if kl is None else kl
        rewards = rm.token_rewards(step.rewards, zero_kl, mask, reward_kl)  # (B, T)
        scores = rm.masked_sum(rewards, mask, dim=1)  # (B,) reward minus KL penalty
        returns = None
        if self.advantage == "gae":
            if step.values is None:
                raise ValueError("gae needs the critic's values")
            advantages, returns = rm.gae(rewards, step.values, mask, self.gamma, self.lam)
            if self.whiten_advantages:
                advantages = rm.masked_whiten(advantages, mask)
        elif self.advantage == "reinforce_pp":
            advantages = rm.reinforce_pp_advantages(rewards, mask, self.gamma)
        elif self.advantage == "reinforce_pp_baseline":
            advantages = rm.reinforce_pp_baseline_advantages(scores, step.group, mask)
        else:
            per_episode = GROUP_ADVANTAGES[self.advantage](scores, step.group)
            advantages = per_episode[:, None] * mask
        return Advantages(advantages, returns, kl)

    def loss_mask(self, mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """Returns the tokens that enter the loss: all, or (mask_truncated) all but those
        of completions cut off at the length limit. `truncated` is (B,) bool."""
        if not self.mask_truncated:
            return mask
        return mask * (~truncated).to(mask.dtype)[:, None]

    def correction_weights(
        self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Returns (B, T) rollout-correction weights (1 where vLLM's logprobs are unknown:
        the caller passes old_logp there)."""
        return rm.rollout_correction_weights(
            old_logp, rollout_logp, mask, self.rollout_correction, self.rollout_correction_clip
        )

    # ------------------------------------------------------------------ loss

    def loss(
        self, micro: MicroBatch, total_tokens: float, total_sequences: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns a micro-batch's share of its mini-batch's loss (divided by the mini-batch's
        `total_tokens` or `total_sequences`), and metrics that add up the same way."""
        mask = micro.mask
        token_loss, clipped = rm.policy_token_loss(
            self.policy_loss,
            micro.logp,
            micro.old_logp,
            micro.advantages,
            mask,
            self.clip_low,
            self.clip_high,
        )
        token_loss = token_loss * micro.correction
        loss = rm.aggregate(
            token_loss,
            mask,
            self.loss_aggregation,
            total_tokens,
            total_sequences,
            self.max_length,
        )
        metrics = {"policy_loss": float(loss.detach())}
        metrics["clip_fraction"] = float(rm.masked_mean(clipped.to(mask.dtype), mask, total_tokens))
        if self.kl_mode == "loss" and micro.ref_logp is not None:
            kl = rm.kl_estimate(micro.logp, micro.ref_logp, self.kl_estimator)
            kl_loss = rm.masked_mean(kl, mask, total_tokens)
            loss = loss + self.kl_coef * kl_loss
            metrics["kl_loss"] = float(kl_loss.detach())
        if micro.entropy is not None:
            entropy = rm.masked_mean(micro.entropy, mask, total_tokens)
            metrics["entropy"] = float(entropy.detach())
            if self.needs_entropy_gradient:
                loss = loss - self.entropy_coef * entropy
        if micro.values is not None:
            value_loss, value_clipped = rm.value_loss(
                micro.values, micro.old_values, micro.returns, mask, self.value_clip, total_tokens
            )
            loss = loss + self.vf_coef * value_loss
            metrics["value_loss"] = float(value_loss.detach())
            metrics["value_clip_fraction"] = float(value_clipped)
        return loss, metrics


GROUP_ADVANTAGES = {
    "grpo": rm.grpo_advantages,
    "dr_grpo": rm.dr_grpo_advantages,
    "rloo": rm.rloo_advantages,
}
