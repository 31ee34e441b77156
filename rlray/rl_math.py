"""PPO math as pure functions on tensors: GAE, whitening, clipped losses, KL, entropy.

Nothing here knows about Ray, configs or models. Every function takes tensors and
plain numbers and returns tensors, so each one is tested against hand-computed
values in tests/test_ppo_math.py.

Shapes: B is the number of episodes, T the number of completion tokens (right
padded). `mask` is 1.0 on real completion tokens and 0.0 on padding; values at
padded positions never change a result.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k3")


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Returns the sum of `x` over positions where `mask` is 1 (padding may hold NaN)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, token_count: float | None = None
) -> torch.Tensor:
    """Returns the mean of `x` over unmasked positions.

    `token_count` overrides the denominator: gradient accumulation passes the
    token count of the whole mini-batch so that micro-batch losses add up to
    exactly the mini-batch loss.
    """
    denominator = mask.sum() if token_count is None else torch.tensor(float(token_count))
    return masked_sum(x, mask) / denominator.clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Returns `x` shifted and scaled to mean 0, std 1 over unmasked positions; 0 on padding."""
    mean = masked_mean(x, mask)
    centered = torch.where(mask.bool(), x - mean, torch.zeros_like(x))
    var = masked_mean(centered**2, mask)
    return centered * torch.rsqrt(var + eps)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (advantages, returns), each (B, T), by generalised advantage estimation.

    delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 after the last real token;
    A_t = delta_t + gamma * lam * A_{t+1};  returns R_t = A_t + V_t.
    (Schulman et al. 2016, https://arxiv.org/abs/1506.02438, eq. 16.)
    Padded positions get 0 and contribute nothing to earlier positions.
    """
    keep = mask.bool()
    rewards = torch.where(keep, rewards, torch.zeros_like(rewards))
    values = torch.where(keep, values, torch.zeros_like(values))
    batch, steps = rewards.shape
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(batch, dtype=rewards.dtype)
    next_value = torch.zeros(batch, dtype=rewards.dtype)
    for t in reversed(range(steps)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(keep[:, t], delta + gamma * lam * running, torch.zeros_like(running))
        advantages[:, t] = running
        next_value = values[:, t]
    returns = torch.where(keep, advantages + values, torch.zeros_like(values))
    return advantages, returns


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Returns a per-token estimate of KL(policy || reference) from sampled-token logprobs.

    k1 = log p - log q (unbiased, can be negative); k3 = (q/p) - 1 - log(q/p)
    (unbiased and always >= 0). Both from http://joschu.net/blog/kl-approx.html.
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def token_rewards(
    final_reward: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Returns (B, T) per-token rewards: -kl_coef * kl everywhere, plus the episode's
    reward on its last real token."""
    rewards = torch.where(mask.bool(), -kl_coef * kl, torch.zeros_like(kl))
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)  # (B,)
    rows = torch.arange(rewards.shape[0])
    rewards[rows, last] += final_reward * (mask.sum(dim=1) > 0)
    return rewards


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    token_count: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss, clip_fraction) of the PPO clipped surrogate objective.

    loss = mean_t max(-A_t * r_t, -A_t * clip(r_t, 1 - clip, 1 + clip)), r_t = exp(logp - old_logp)
    (Schulman et al. 2017, https://arxiv.org/abs/1707.06347, eq. 7).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask, token_count)
    clip_fraction = masked_mean((clipped > unclipped).float(), mask).detach()
    return loss, clip_fraction


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    token_count: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss, clip_fraction) of the clipped value loss
    0.5 * mean_t max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask, token_count)
    clip_fraction = masked_mean((clipped_error > unclipped_error).float(), mask).detach()
    return loss, clip_fraction


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Returns the (B, T) entropy of the categorical distributions given by (B, T, V) logits."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Returns the (B, T) logprobs of `tokens` (B, T) under (B, T, V) logits."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """Returns 1 - Var[R - V] / Var[R] over unmasked positions (1 is perfect, <= 0 is useless)."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    if var_returns.item() == 0.0:
        return float("nan")
    return float(1.0 - var_residual / var_returns)
