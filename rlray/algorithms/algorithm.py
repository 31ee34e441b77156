"""The algorithm: advantages and losses, as the config's algorithm section chose them.

An `Algorithm` knows nothing of models, devices or Ray. Given a step's rewards, the
learner's logprobs (before the update), the reference's and the critic's values, it
returns advantages; given a micro-batch's fresh logprobs and values, it returns the
loss. The engine (rlray/learner/engine.py) runs the forward passes and the optimizer; the
learner (rlray/learner/rl.py) hands tensors from one to the other. The estimator and
the policy loss are looked up in their registries (estimators.py, losses.py); every
formula lives in rl_math.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlray.algorithms import rl_math as rm
from rlray.algorithms.estimators import ESTIMATORS, EstimatorInputs
from rlray.algorithms.losses import POLICY_LOSSES

if TYPE_CHECKING:  # the config's section; the config reads this package's registries
    from rlray.config import AlgorithmConfig


@dataclass
class StepInputs:
    """What advantages are computed from, for every episode of a step (B rows)."""

    rewards: torch.Tensor  # (B,) each episode's total reward
    group: torch.Tensor  # (B,) long: index of the episode's group (its prompt)
    sample: torch.Tensor  # (B,) long: index of its sample (an agent trace's episodes: one)
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
    """The config's algorithm section (its numbers, read where they are used) and the
    completion length limit."""

    settings: AlgorithmConfig
    max_length: int = 1
    """Completion length limit (rollout.max_new_tokens): seq_mean_token_sum_norm's constant."""

    @property
    def clip_low(self) -> float:
        """The lower clip offset: the config's, else the policy loss's own."""
        own = POLICY_LOSSES[self.settings.policy_loss].clip_low
        return own if self.settings.clip_low is None else self.settings.clip_low

    @property
    def clip_high(self) -> float:
        """The upper clip offset: the config's, else the policy loss's own."""
        own = POLICY_LOSSES[self.settings.policy_loss].clip_high
        return own if self.settings.clip_high is None else self.settings.clip_high

    @property
    def loss_aggregation(self) -> str:
        """How token losses become the loss: the config's, else the policy loss's own."""
        own = POLICY_LOSSES[self.settings.policy_loss].aggregation
        return self.settings.loss_aggregation or own

    @property
    def rollout_correction(self) -> str:
        """The rollout-correction level: the config's, else the policy loss's own."""
        own = POLICY_LOSSES[self.settings.policy_loss].rollout_correction
        return self.settings.rollout_correction or own

    @property
    def needs_critic(self) -> bool:
        return ESTIMATORS[self.settings.advantage].needs_critic

    @property
    def needs_reference(self) -> bool:
        return self.settings.kl_coef > 0

    @property
    def needs_entropy_gradient(self) -> bool:
        return self.settings.entropy_coef > 0

    # ------------------------------------------------------------------ advantages

    def advantages(self, step: StepInputs) -> Advantages:
        """Returns the step's advantages (and critic targets), KL-in-reward included."""
        s, mask = self.settings, step.mask
        kl = None
        if step.ref_logp is not None:
            kl = rm.kl_estimate(step.old_logp, step.ref_logp, s.kl_estimator)
        reward_kl = s.kl_coef if s.kl_mode == "reward" and kl is not None else 0.0
        zero_kl = torch.zeros_like(mask) if kl is None else kl
        rewards = rm.token_rewards(step.rewards, zero_kl, mask, reward_kl)  # (B, T)
        scores = rm.masked_sum(rewards, mask, dim=1)  # (B,) reward minus KL penalty
        inputs = EstimatorInputs(
            rewards,
            scores,
            step.group,
            step.sample,
            mask,
            step.values,
            s.gamma,
            s.lam,
            s.whiten_advantages,
        )
        advantages, returns = ESTIMATORS[s.advantage].compute(inputs)
        return Advantages(advantages, returns, kl)

    def loss_mask(self, mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """Returns the tokens that enter the loss: all, or (mask_truncated) all but those
        of completions cut off at the length limit. `truncated` is (B,) bool."""
        if not self.settings.mask_truncated:
            return mask
        return mask * (~truncated).to(mask.dtype)[:, None]

    def correction_weights(
        self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Returns (B, T) rollout-correction weights (1 where vLLM's logprobs are unknown:
        the caller passes old_logp there)."""
        return rm.rollout_correction_weights(
            old_logp,
            rollout_logp,
            mask,
            self.rollout_correction,
            self.settings.rollout_correction_clip,
        )

    # ------------------------------------------------------------------ loss

    def loss(
        self,
        micro: MicroBatch,
        total_tokens: float,
        total_sequences: float,
        sampled_sequences: float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns a micro-batch's share of its mini-batch's loss, and metrics that add up
        the same way. The mini-batch's counts: `total_tokens` and `total_sequences` in
        the loss, and `sampled_sequences`, every row whether masked or not (Dr. GRPO's G).

        The policy, KL, entropy and value terms are each aggregated over tokens alike
        (loss_aggregation), so that a coefficient means the same in every mode."""
        s, mask = self.settings, micro.mask

        def aggregate(token_values: torch.Tensor) -> torch.Tensor:
            return rm.aggregate(
                token_values,
                mask,
                self.loss_aggregation,
                total_tokens,
                total_sequences,
                self.max_length,
                sampled_sequences,
            )

        token_loss, clipped = POLICY_LOSSES[s.policy_loss].token_loss(
            micro.logp, micro.old_logp, micro.advantages, mask, self.clip_low, self.clip_high
        )
        loss = aggregate(token_loss * micro.correction)
        metrics = {"policy_loss": float(loss.detach())}
        metrics["clip_fraction"] = self._token_mean(clipped, mask, total_tokens)
        if s.kl_mode == "loss" and micro.ref_logp is not None:
            kl_loss = aggregate(rm.kl_estimate(micro.logp, micro.ref_logp, s.kl_estimator))
            loss = loss + s.kl_coef * kl_loss
            metrics["kl_loss"] = float(kl_loss.detach())
        if micro.entropy is not None:
            # Reported as a token mean: a property of the policy, the same in every mode.
            metrics["entropy"] = self._token_mean(micro.entropy, mask, total_tokens)
            if self.needs_entropy_gradient:
                loss = loss - s.entropy_coef * aggregate(micro.entropy)
        if micro.values is not None:
            value_tokens, value_clipped = rm.value_token_loss(
                micro.values, micro.old_values, micro.returns, s.value_clip
            )
            value_loss = aggregate(value_tokens)
            loss = loss + s.vf_coef * value_loss
            metrics["value_loss"] = float(value_loss.detach())
            metrics["value_clip_fraction"] = self._token_mean(value_clipped, mask, total_tokens)
        return loss, metrics

    @staticmethod
    def _token_mean(x: torch.Tensor, mask: torch.Tensor, total_tokens: float) -> float:
        """Returns the micro-batch's share of the mini-batch's token mean of `x`."""
        return float(rm.masked_mean(x.detach().to(mask.dtype), mask, total_tokens))
