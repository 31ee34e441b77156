"""Policy losses, by name: what algorithm.policy_loss chooses.

A policy loss turns a micro-batch's fresh logprobs, the logprobs before the update and
the advantages into (B, T) token losses, and says where its clip was active. Adding one
is a decorated function here and its test: the config's choices, `--help` and the
defaults of the clips, the loss aggregation and the rollout correction read this table.
The math is in rl_math.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlray.algorithms.lazy import rl_math as rm

if TYPE_CHECKING:
    import torch

TokenLoss = Callable[..., tuple["torch.Tensor", "torch.Tensor"]]
"""(logp, old_logp, advantages, mask, clip_low, clip_high) -> (B, T) token losses and
where the clip was active; tensors (B, T)."""


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    token_loss: TokenLoss
    summary: str
    """One line on what it computes (--help shows it)."""
    clip_low: float
    clip_high: float
    """The clip offsets used when the config leaves them unset."""
    aggregation: str = "token_mean"
    """The loss aggregation used when the config leaves it unset (rl_math.aggregate)."""
    rollout_correction: str = "token"
    """The rollout-correction level used when the config leaves it unset."""


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def policy_loss(
    name: str,
    *,
    clips: tuple[float, float],
    aggregation: str = "token_mean",
    rollout_correction: str = "token",
) -> Callable[[TokenLoss], Any]:
    """Registers the decorated function as the policy loss `name`, with its usual clip
    offsets (low, high), loss aggregation and rollout-correction level; its docstring's
    first line is its summary."""

    def register(token_loss: TokenLoss) -> Any:
        summary = (token_loss.__doc__ or "").strip().splitlines()[0]
        POLICY_LOSSES[name] = PolicyLoss(
            name, token_loss, summary, *clips, aggregation, rollout_correction
        )
        return token_loss

    return register


@policy_loss("ppo", clips=(0.2, 0.2))
def ppo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate on the token ratio; clip_high 0.28 is DAPO's clip-higher."""
    return rm.ppo_token_loss(logp, old_logp, advantages, clip_low, clip_high)


# GSPO's ratio is a per-token geometric mean, so it moves far less (the paper's offsets).
# Its objective weighs each token 1 / (G |y_i|), the mean of each sequence's token mean;
# its rollout correction is at the same level as its ratio, the geometric mean.
@policy_loss(
    "gspo",
    clips=(3e-4, 4e-4),
    aggregation="seq_mean_token_mean",
    rollout_correction="geometric",
)
def gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate on the sequence ratio, the geometric mean of its token ratios."""
    return rm.gspo_token_loss(logp, old_logp, advantages, mask, clip_low, clip_high)


# CISPO truncates its weight at 5, with no lower bound (ScaleRL, arXiv 2510.13786).
@policy_loss("cispo", clips=(1.0, 4.0))
def cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE weighted by the truncated token ratio, so clipped tokens still learn."""
    return rm.cispo_token_loss(logp, old_logp, advantages, clip_low, clip_high)
