"""The RL math as pure functions on tensors: advantage estimators, policy and value
losses, loss aggregation, KL estimators, rollout correction, preference losses (DPO,
IPO, Bradley-Terry).

Nothing here knows about Ray, configs or models. Every function takes tensors and
plain numbers and returns tensors created on the device of its inputs, so each one is
tested against hand-computed values (tests/test_rl_math.py) and runs unchanged on a GPU.

Shapes: B is the number of episodes, T the number of completion tokens (right padded).
`mask` is 1.0 on the completion tokens the policy generated and 0.0 elsewhere: padding,
and in a multi-turn episode the observation and tool tokens between its turns (see
Episode.completion_mask). Values at masked positions never change a result; estimators
over time (returns, GAE) step over them as if the policy's tokens were contiguous.
`group` (B,) holds each episode's group index: the samples of one prompt share it
(group estimators compare them).
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------- masked reductions


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Returns the sum of `x` where `mask` is 1 (all of it, or along `dim`); padding may
    hold NaN or inf."""
    kept = torch.where(mask.bool(), x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, denominator: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Returns the mean of `x` over unmasked positions.

    `denominator` overrides the count: gradient accumulation passes the token count of
    the whole mini-batch so that micro-batch losses add up to exactly its loss.
    """
    count = mask.sum() if denominator is None else torch.as_tensor(denominator, dtype=x.dtype)
    return masked_sum(x, mask) / count.to(x.device).clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Returns `x` shifted and scaled to mean 0, std 1 over unmasked positions; 0 on padding."""
    mean = masked_mean(x, mask)
    centered = torch.where(mask.bool(), x - mean, torch.zeros_like(x))
    var = masked_mean(centered**2, mask)
    return centered * torch.rsqrt(var + eps)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Returns the (B,) mean of `x` over each row's unmasked positions (0 for empty rows)."""
    return masked_sum(x, mask, dim=1) / mask.sum(dim=1).clamp(min=1.0)


# ---------------------------------------------------------------- rewards and returns


def token_rewards(
    final_reward: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Returns (B, T) per-token rewards: -kl_coef * kl on every unmasked token, plus the
    episode's (B,) reward on its last unmasked token."""
    rewards = torch.where(mask.bool(), -kl_coef * kl, torch.zeros_like(kl))
    last = last_unmasked(mask)
    has_tokens = mask.sum(dim=1) > 0
    final = torch.where(has_tokens, final_reward.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards.scatter_add(1, last[:, None], final[:, None])


def last_unmasked(mask: torch.Tensor) -> torch.Tensor:
    """Returns the (B,) column of each row's last unmasked position (0 for empty rows)."""
    columns = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), columns, torch.zeros_like(columns)).amax(dim=1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns (B, T) reward-to-go G_t = sum_{k >= t} gamma^(k - t) r_k over real tokens."""
    keep = mask.bool()
    rewards = torch.where(keep, rewards, torch.zeros_like(rewards))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(keep, returns, torch.zeros_like(returns))


# ---------------------------------------------------------------- advantage estimators


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (advantages, returns), each (B, T), by generalised advantage estimation.

    delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 after the last real token;
    A_t = delta_t + gamma * lam * A_{t+1};  returns R_t = A_t + V_t.
    (Schulman et al. 2016, https://arxiv.org/abs/1506.02438, eq. 16.)
    t + 1 is the next unmasked position: masked positions (padding, or observation
    tokens between turns) get 0 and are stepped over, not treated as the episode's end.
    """
    keep = mask.bool()
    rewards = torch.where(keep, rewards, torch.zeros_like(rewards))
    values = torch.where(keep, values, torch.zeros_like(values))
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(keep[:, t], delta + gamma * lam * running, running)
        advantages[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
        next_value = torch.where(keep[:, t], values[:, t], next_value)
    returns = torch.where(keep, advantages + values, torch.zeros_like(values))
    return advantages, returns


def sample_weights(sample: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Returns (B,) each row's weight in its group's statistics, 1/k for a row of a sample
    of k rows (an agent trace's k episodes are one sample of its prompt); 1 for every row
    without `sample` (each row its own sample)."""
    if sample is None:
        return torch.ones_like(like)
    rows = torch.zeros_like(like).index_add_(0, sample, torch.ones_like(like))
    return 1.0 / rows[sample]


def _group_sum(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(values).index_add_(0, group, values)[group]


def group_mean(
    scores: torch.Tensor, group: torch.Tensor, sample: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns (B,) the mean score of each episode's group, a sample counted once however
    many rows it has (sample_weights)."""
    weight = sample_weights(sample, scores)
    return _group_sum(weight * scores, group) / _group_sum(weight, group).clamp(min=1e-12)


def group_std(
    scores: torch.Tensor, group: torch.Tensor, sample: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns (B,) the unbiased (n - 1) standard deviation of each episode's group of n
    samples, a sample counted once (sample_weights); 0 for groups of one."""
    weight = sample_weights(sample, scores)
    count = _group_sum(weight, group)
    squares = weight * (scores - group_mean(scores, group, sample)) ** 2
    return (_group_sum(squares, group) / (count - 1.0).clamp(min=1.0)).sqrt()


def grpo_advantages(
    scores: torch.Tensor,
    group: torch.Tensor,
    eps: float = 1e-6,
    sample: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns (B,) GRPO advantages A_i = (r_i - mean_g) / (std_g + eps), mean and
    unbiased std over the episode's group g of samples (each counted once).
    (Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300, sec. 4.1.2.)"""
    spread = group_std(scores, group, sample)
    return (scores - group_mean(scores, group, sample)) / (spread + eps)


def dr_grpo_advantages(
    scores: torch.Tensor, group: torch.Tensor, sample: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns (B,) Dr. GRPO advantages A_i = r_i - mean_g: GRPO without the std division,
    which over-weights groups that are nearly all right or all wrong.
    (Liu et al. 2025, Understanding R1-Zero-Like Training, https://arxiv.org/abs/2503.20783.)"""
    return scores - group_mean(scores, group, sample)


def rloo_advantages(
    scores: torch.Tensor, group: torch.Tensor, sample: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns (B,) REINFORCE leave-one-out advantages A_i = r_i - the mean of the group's
    other samples (the episode's own sample, all its rows, left out) = r_i - (n mean_g -
    R_s) / (n - 1) over a group of n samples, R_s the mean score of the episode's sample
    s; 0 for groups of one sample.
    (Ahmadian et al. 2024, Back to Basics, https://arxiv.org/abs/2402.14740, eq. 4.)"""
    weight = sample_weights(sample, scores)
    count = _group_sum(weight, group)
    total = _group_sum(weight * scores, group)
    own = scores if sample is None else _group_sum(weight * scores, sample)
    others = (total - own) / (count - 1.0).clamp(min=1.0)
    return torch.where(count > 1.5, scores - others, torch.zeros_like(scores))


def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Returns (B, T) REINFORCE++ advantages: the discounted reward-to-go of the per-token
    rewards (KL penalty included), whitened over every real token of the batch.
    (Hu 2025, REINFORCE++, https://arxiv.org/abs/2501.03262, eq. 6-8.)"""
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor,
    group: torch.Tensor,
    mask: torch.Tensor,
    sample: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns (B, T) REINFORCE++-baseline advantages: r_i - mean_g on every token of the
    episode, then whitened over every real token of the batch (the group mean removes
    the prompt's difficulty; the batch statistics set the scale).
    (Hu 2025, REINFORCE++, https://arxiv.org/abs/2501.03262, sec. 3.2.)"""
    centered = dr_grpo_advantages(scores, group, sample)
    return masked_whiten(centered[:, None].expand_as(mask), mask)


# ---------------------------------------------------------------- policy losses

LOG_RATIO_LIMIT = 20.0
"""Bound on a log ratio before it is exponentiated (verl's): exp overflows float32 past
88.7, and an infinite ratio makes the loss infinite and its gradient NaN."""


def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """Returns (B, T) ratios exp(logp - old_logp), the log ratio clamped to
    [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]: a token beyond it gives no gradient."""
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def ppo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (B, T) PPO clipped-surrogate losses and where the clip was active.

    loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)), r_t = exp(logp - old_logp)
    (Schulman et al. 2017, https://arxiv.org/abs/1707.06347, eq. 7; the separate upper
    clip is DAPO's clip-higher, Yu et al. 2025, https://arxiv.org/abs/2503.14476.)
    r_t is token_ratio's, its log clamped to [-20, 20].
    """
    return _clipped_surrogate(token_ratio(logp, old_logp), advantages, clip_low, clip_high)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (B, T) GSPO losses and where the clip was active.

    The ratio is the sequence's: s_i = exp(mean_t (logp - old_logp)), the geometric mean
    of its token ratios, clipped to [1 - clip_low, 1 + clip_high] like PPO's. As GSPO-token,
    each token carries s_i's value with its own logprob's gradient,
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], so advantages may vary along the sequence.
    (Zheng et al. 2025, Group Sequence Policy Optimization, https://arxiv.org/abs/2507.18071,
    eq. 7 and 11.)
    """
    log_ratio = sequence_mean(logp - old_logp, mask).detach()  # (B,)
    # Added last so that the value is exactly the sequence ratio (no round-off).
    token_log_ratio = logp - logp.detach() + log_ratio[:, None]
    ratio = torch.exp(token_log_ratio.clamp(max=LOG_RATIO_LIMIT))
    return _clipped_surrogate(ratio, advantages, clip_low, clip_high)


def cispo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (B, T) CISPO losses and where the weight was truncated.

    loss_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * logp_t: REINFORCE with a
    truncated importance weight, so clipped tokens still give a gradient (PPO's give none).
    (MiniMax 2025, MiniMax-M1, https://arxiv.org/abs/2506.13585, eq. 4-5.)
    """
    ratio = token_ratio(logp, old_logp).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logp, weight != ratio


# ---------------------------------------------------------------- loss aggregation

LOSS_AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
    max_length: float | None = None,
    sampled_sequences: float | None = None,
) -> torch.Tensor:
    """Returns the scalar loss of (B, T) token losses under aggregation `mode`:

    token_mean               sum_i,t l_i,t / N_tokens               (every token alike)
    seq_mean_token_mean      sum_i (sum_t l_i,t / |y_i|) / N_seq     (every sequence alike)
    seq_mean_token_sum       sum_i sum_t l_i,t / N_seq
    seq_mean_token_sum_norm  sum_i sum_t l_i,t / (G * max_length)  (Dr. GRPO: no
                             length bias, https://arxiv.org/abs/2503.20783, eq. 3)

    N_tokens and N_seq are `total_tokens` and `total_sequences` when given (a micro-batch
    passes its mini-batch's, so micro-batch losses add up to the mini-batch loss), else
    this batch's real tokens and the sequences with at least one real token. G is
    `sampled_sequences`, else the B rows: every sequence sampled, counted whether or not
    `mask` leaves it any token (a truncated completion masked out still counts), so
    that Dr. GRPO's normaliser stays a constant.
    """
    if total_tokens is None:
        total_tokens = mask.sum()
    if total_sequences is None:
        total_sequences = (mask.sum(dim=1) > 0).sum()
    if sampled_sequences is None:
        sampled_sequences = token_loss.shape[0]
    if mode == "token_mean":
        return masked_sum(token_loss, mask) / _at_least_one(total_tokens, token_loss)
    if mode == "seq_mean_token_mean":
        per_sequence = sequence_mean(token_loss, mask)
        return per_sequence.sum() / _at_least_one(total_sequences, token_loss)
    if mode == "seq_mean_token_sum":
        return masked_sum(token_loss, mask) / _at_least_one(total_sequences, token_loss)
    if mode == "seq_mean_token_sum_norm":
        if max_length is None:
            raise ValueError("seq_mean_token_sum_norm needs max_length")
        sequences = _at_least_one(sampled_sequences, token_loss)
        return masked_sum(token_loss, mask) / (sequences * max_length)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGGREGATIONS}")


def _at_least_one(count: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, dtype=like.dtype).to(like.device).clamp(min=1.0)


# ---------------------------------------------------------------- value loss, KL, entropy


def value_token_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (B, T) clipped value losses and where the clip was active:
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2), aggregated over
    tokens as the policy loss is (aggregate)."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped_error, clipped_error), clipped_error > unclipped_error


KL_ESTIMATORS = ("k1", "k2", "k3")
K3_LIMIT = 10.0
"""Bound on k3 (verl's): at a log ratio of -20 it is 4.85e8, and one token would decide
the update."""


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Returns a per-token estimate of KL(policy || reference) from sampled-token logprobs,
    with log r = logp - ref_logp (http://joschu.net/blog/kl-approx.html):

    k1 = log r           unbiased, can be negative
    k2 = (log r)^2 / 2   biased, low variance
    k3 = (1/r) - 1 + log r   unbiased and always >= 0; log r clamped to [-20, 20] and
                             k3 to at most 10, as verl's low_var_kl

    What their gradients are depends on where they go. As a loss term, grad k1 is 0 in
    expectation, E[grad k2] = grad KL(pi || ref) and E[grad k3] = grad KL(ref || pi). As
    a reward penalty, the policy gradient takes E[k grad log pi], which is
    grad KL(pi || ref) for k1 only (tests/test_algorithm.py works both out exactly).
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return (torch.expm1(-log_ratio) + log_ratio).clamp(max=K3_LIMIT)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Returns the (B, T) logprobs of `tokens` (B, T) under (B, T, V) logits, without
    materialising a second (B, T, V) tensor of log-softmax values."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Returns the (B, T) entropy of the categorical distributions given by (B, T, V) logits."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """Returns 1 - Var[R - V] / Var[R] over unmasked positions (1 is perfect, <= 0 is
    useless; NaN when the returns do not vary)."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    if var_returns.item() == 0.0:
        return float("nan")
    return float(1.0 - var_residual / var_returns)


# ---------------------------------------------------------------- rollout correction

ROLLOUT_CORRECTIONS = ("token", "sequence", "geometric", "off")


def rollout_correction_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str, clip: float
) -> torch.Tensor:
    """Returns (B, T) truncated importance weights from the sampling policy (vLLM's
    logprobs, `rollout_logp`) to the learner's policy before the update (`old_logp`):

    token      w_t = min(exp(old_t - rollout_t), clip)
    sequence   w_t = min(exp(sum_t (old_t - rollout_t)), clip) on every token of the sequence
    geometric  w_t = min(exp(mean_t (old_t - rollout_t)), clip) on every token of the
               sequence: the geometric mean of its token ratios, GSPO's level
    off        w_t = 1

    Detached: a weight, not a path for gradients. It corrects both an engine mismatch
    (bf16 kernels differ from the learner's) and staleness (a policy K versions old).
    (Yao et al. 2025, Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training, https://fengyao.notion.site/off-policy-rl; Espeholt et al. 2018, IMPALA's
    truncated importance sampling, https://arxiv.org/abs/1802.01561.)
    """
    log_ratio = torch.where(mask.bool(), old_logp - rollout_logp, torch.zeros_like(old_logp))
    if level == "token":
        weights = torch.exp(log_ratio.clamp(max=LOG_RATIO_LIMIT))
    elif level == "sequence":
        total = log_ratio.sum(dim=1, keepdim=True)  # (B, 1)
        weights = torch.exp(total.clamp(max=LOG_RATIO_LIMIT)).expand_as(mask)
    elif level == "geometric":
        mean = sequence_mean(log_ratio, mask)[:, None]  # (B, 1)
        weights = torch.exp(mean.clamp(max=LOG_RATIO_LIMIT)).expand_as(mask)
    elif level == "off":
        return torch.ones_like(old_logp)
    else:
        raise ValueError(
            f"unknown rollout correction {level!r}; expected one of {ROLLOUT_CORRECTIONS}"
        )
    return weights.clamp(max=clip).detach()


def logprob_mismatch(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Returns how far vLLM's logprobs are from the learner's over unmasked tokens: the
    mean and max absolute difference, and the share of tokens whose ratio
    exp(old - rollout) lies outside [0.5, 2]."""
    gap = torch.where(mask.bool(), (old_logp - rollout_logp).abs(), torch.zeros_like(old_logp))
    far = (gap > torch.log(torch.tensor(2.0, dtype=gap.dtype, device=gap.device))).to(gap.dtype)
    return {
        "mean": masked_mean(gap, mask),
        "max": gap.max() if gap.numel() else gap.sum(),
        "outside_share": masked_mean(far, mask),
    }


# ---------------------------------------------------------------- preference losses
#
# Pairs of completions of one prompt, chosen (y_w) over rejected (y_l). `*_logp` are
# (B,) sequence logprobs (the sum over the completion's policy tokens) of the policy and
# of the frozen reference model.


def preference_margins(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
) -> torch.Tensor:
    """Returns (B,) h = [log pi(y_w) - log ref(y_w)] - [log pi(y_l) - log ref(y_l)]: how
    much more the policy than the reference prefers the chosen completion."""
    return (chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp)


def dpo_loss(margins: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """Returns (B,) sigmoid DPO losses -log sigmoid(beta h); with label smoothing eps
    (the chosen label is wrong with probability eps, "conservative DPO"),
    -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)."""
    scaled = beta * margins
    logsigmoid = torch.nn.functional.logsigmoid
    return -(1.0 - label_smoothing) * logsigmoid(scaled) - label_smoothing * logsigmoid(-scaled)


def ipo_loss(margins: torch.Tensor, beta: float) -> torch.Tensor:
    """Returns (B,) IPO losses (h - 1 / (2 beta))^2: the margin is pulled to a fixed
    target instead of pushed without bound. IPO's h is usually taken over per-token mean
    logprobs (the caller's choice)."""
    return (margins - 1.0 / (2.0 * beta)) ** 2


def implicit_rewards(logp: torch.Tensor, ref_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """Returns (B,) DPO's implicit rewards beta (log pi(y) - log ref(y)); the chosen one
    above the rejected one is a correctly ranked pair."""
    return beta * (logp - ref_logp)


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, center_coef: float = 0.0
) -> torch.Tensor:
    """Returns (B,) reward-model losses -log sigmoid(r(y_w) - r(y_l)): the negative log
    likelihood of the preference under the Bradley-Terry model, plus
    center_coef * (r(y_w) + r(y_l))^2. The likelihood sees score differences only, so
    each prompt's scores may drift by an offset of their own; the second term (TRL's
    center_rewards_coefficient) holds every pair's scores around 0, so that a score's
    sign means the same for every prompt."""
    loss = -torch.nn.functional.logsigmoid(chosen_scores - rejected_scores)
    if center_coef:
        loss = loss + center_coef * (chosen_scores + rejected_scores) ** 2
    return loss


# ---------------------------------------------------------------- finiteness


class NonFiniteError(FloatingPointError):
    """A NaN or infinite value where an update needs numbers; the message names it."""


def check_finite(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Returns None if `x` is finite (where `mask` is 1, if given: padding may hold
    anything); else raises NonFiniteError naming `name`, the first bad value and its index."""
    x = x.detach()
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask.bool()
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        value = float(x[tuple(index)]) if index else float(x)
        raise NonFiniteError(f"{name} is not finite ({value} at {index})")
