"""The RL math against values worked out by hand, and its invariances: padding changes
nothing, micro-batches give the gradient of the whole batch, vectorised forms equal
loops, and every tensor is made on the device of the inputs."""

import math
import statistics

import pytest
import torch

from rlray.algorithms import rl_math as rm
from rlray.algorithms.losses import POLICY_LOSSES

LN2 = math.log(2.0)

# ---------------------------------------------------------------- returns and GAE


def test_gae_matches_three_step_hand_computation():
    # gamma=0.9, lam=0.8, V=[0.5, 0.6, 0.7], r=[0, 0, 1]:
    # d2 = 1 - 0.7 = 0.3;            A2 = 0.3
    # d1 = 0.9*0.7 - 0.6 = 0.03;     A1 = 0.03 + 0.72*0.3   = 0.246
    # d0 = 0.9*0.6 - 0.5 = 0.04;     A0 = 0.04 + 0.72*0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = rm.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]))


def test_gae_padded_positions_change_nothing():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    clean_adv, clean_ret = rm.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    garbage_rewards = rewards.clone()
    garbage_rewards[0, 3:] = torch.tensor([7.0, float("nan")])
    garbage_values = values.clone()
    garbage_values[0, 3:] = torch.tensor([-3.0, float("inf")])
    adv, ret = rm.gae(garbage_rewards, garbage_values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, clean_adv)
    torch.testing.assert_close(ret, clean_ret)
    assert adv[0, 3:].tolist() == [0.0, 0.0]


def test_gae_steps_over_observation_tokens_between_turns():
    # A two-turn episode: policy tokens at 0, 1 and 4, observation tokens at 2 and 3
    # (mask 0), padding at 5. GAE over the policy's tokens alone is the three-step hand
    # computation above (V = [0.5, 0.6, 0.7], r = [0, 0, 1]): the turn boundary neither
    # ends the episode nor lets the observation's values or rewards in.
    rewards = torch.tensor([[0.0, 0.0, 5.0, 5.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, -4.0, 8.0, 0.7, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = rm.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.0, 0.0, 0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 0.0, 0.0, 1.0, 0.0]]))


def test_returns_and_token_rewards_step_over_observation_tokens():
    # Policy tokens at 0 and 3; the final reward lands on 3, the last policy token (not
    # on column mask.sum() - 1 = 1, an observation token), and G_0 = 0.9 * 1.
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]])
    kl = torch.tensor([[0.2, 7.0, 7.0, 0.4, 7.0]])
    rewards = rm.token_rewards(torch.tensor([1.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.0, 0.0, 0.8, 0.0]]))
    returns = rm.discounted_returns(rewards, mask, gamma=0.9)
    torch.testing.assert_close(returns, torch.tensor([[-0.1 + 0.72, 0.0, 0.0, 0.8, 0.0]]))
    assert rm.last_unmasked(torch.tensor([[0.0, 0.0], [1.0, 0.0]])).tolist() == [0, 0]


def test_gae_vectorised_over_batch_equals_per_episode_loop():
    torch.manual_seed(0)
    lengths = [5, 2, 4]
    rewards = torch.randn(3, 5)
    values = torch.randn(3, 5)
    mask = torch.zeros(3, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    adv, _ = rm.gae(rewards, values, mask, gamma=0.95, lam=0.9)
    for i, n in enumerate(lengths):
        expected, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_value = values[i, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[i, t].item() + 0.95 * next_value - values[i, t].item()
            running = delta + 0.95 * 0.9 * running
            expected[t] = running
        torch.testing.assert_close(adv[i, :n], torch.tensor(expected))


def test_discounted_returns_hand_values_and_padding():
    # gamma 0.9, r = [0, 0, 1] -> G = [0.81, 0.9, 1]; the padded row's garbage is ignored.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 5.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    returns = rm.discounted_returns(rewards, mask, gamma=0.9)
    torch.testing.assert_close(returns, torch.tensor([[0.81, 0.9, 1.0], [2.0, 0.0, 0.0]]))


def test_token_rewards_put_score_on_last_real_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards = rm.token_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [1.75, 0.0, 0.0]]))


def test_masked_whiten_hand_values_and_zero_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, variance 2/3 -> (x - 2) / sqrt(2/3)
    s = math.sqrt(1.5)
    torch.testing.assert_close(rm.masked_whiten(x, mask), torch.tensor([[-s, 0.0, s, 0.0]]))


# ---------------------------------------------------------------- group estimators

# Two groups of four: [1, 0, 0, 1] (mean 1/2) and [1, 1, 1, 0] (mean 3/4).
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
GROUP = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_grpo_hand_values():
    # group 0: unbiased variance (4 * 1/4) / 3 = 1/3 -> A = +-(1/2) / sqrt(1/3)
    # group 1: variance (3 * 1/16 + 9/16) / 3 = 1/4 -> A = (1/4) / (1/2), (-3/4) / (1/2)
    a = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor([a, -a, -a, a, 0.5, 0.5, 0.5, -1.5])
    torch.testing.assert_close(rm.grpo_advantages(SCORES, GROUP, eps=0.0), expected)


def test_dr_grpo_hand_values():
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    torch.testing.assert_close(rm.dr_grpo_advantages(SCORES, GROUP), expected)


def test_rloo_hand_values():
    # episode 0: 1 - mean(0, 0, 1) = 2/3; episode 7: 0 - mean(1, 1, 1) = -1
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0])
    torch.testing.assert_close(rm.rloo_advantages(SCORES, GROUP), expected)


def test_uniform_and_single_groups_get_zero_advantage():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.3])
    group = torch.tensor([0, 0, 0, 1])  # a uniform group and a group of one
    for estimator in (rm.grpo_advantages, rm.dr_grpo_advantages, rm.rloo_advantages):
        assert estimator(scores, group).abs().max().item() == 0.0, estimator.__name__


def test_group_estimators_vectorised_equal_a_loop_over_groups():
    torch.manual_seed(1)
    scores = torch.randn(12)
    group = torch.tensor([2, 0, 1, 2, 0, 1, 1, 2, 0, 2, 1, 0])  # interleaved, unequal order
    grpo = rm.grpo_advantages(scores, group, eps=0.0)
    rloo = rm.rloo_advantages(scores, group)
    for i in range(12):
        members = [scores[j].item() for j in range(12) if group[j] == group[i]]
        others = [scores[j].item() for j in range(12) if group[j] == group[i] and j != i]
        mean, std = statistics.mean(members), statistics.stdev(members)
        assert grpo[i].item() == pytest.approx((scores[i].item() - mean) / std, rel=1e-5)
        assert rloo[i].item() == pytest.approx(scores[i].item() - statistics.mean(others), 1e-5)


# An agent task's group: four traces of one prompt rewarded [1, 0, 0, 0], the second made
# of 3 episodes (model calls). Each trace is one sample: the baseline is 1/4, not the
# 1/6 that counting rows gives.
TRACE_SCORES = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
TRACE_GROUP = torch.zeros(6, dtype=torch.long)
TRACE_SAMPLE = torch.tensor([0, 1, 1, 1, 2, 3])


def test_a_trace_is_one_sample_in_its_groups_mean_and_std():
    mean = rm.group_mean(TRACE_SCORES, TRACE_GROUP, TRACE_SAMPLE)
    torch.testing.assert_close(mean, torch.full((6,), 0.25))
    # samples [1, 0, 0, 0]: unbiased variance (9/16 + 3 * 1/16) / 3 = 1/4
    torch.testing.assert_close(rm.group_std(TRACE_SCORES, TRACE_GROUP, TRACE_SAMPLE), mean * 2)


def test_dr_grpo_counts_a_trace_once_hand_values():
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, -0.25, -0.25])
    torch.testing.assert_close(
        rm.dr_grpo_advantages(TRACE_SCORES, TRACE_GROUP, TRACE_SAMPLE), expected
    )


def test_grpo_counts_a_trace_once_hand_values():
    # (r - 1/4) / (1/2)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, -0.5, -0.5])
    advantages = rm.grpo_advantages(TRACE_SCORES, TRACE_GROUP, eps=0.0, sample=TRACE_SAMPLE)
    torch.testing.assert_close(advantages, expected)


def test_rloo_leaves_a_whole_trace_out_hand_values():
    # trace 0: 1 - mean(0, 0, 0) = 1; any other: 0 - mean(1, 0, 0) = -1/3 (its own trace,
    # all its rows, left out; counting rows gave -1/5)
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, -1 / 3, -1 / 3])
    torch.testing.assert_close(
        rm.rloo_advantages(TRACE_SCORES, TRACE_GROUP, TRACE_SAMPLE), expected
    )


def test_reinforce_pp_baseline_centres_on_a_mean_that_counts_a_trace_once():
    mask = torch.ones(6, 1)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, -0.25, -0.25])[:, None]
    advantages = rm.reinforce_pp_baseline_advantages(TRACE_SCORES, TRACE_GROUP, mask, TRACE_SAMPLE)
    torch.testing.assert_close(advantages, rm.masked_whiten(centred, mask))


def test_samples_of_one_row_each_give_the_row_counting_estimators():
    one_each = torch.arange(len(SCORES))
    for name in ("grpo_advantages", "dr_grpo_advantages", "rloo_advantages"):
        estimator = getattr(rm, name)
        torch.testing.assert_close(
            estimator(SCORES, GROUP, sample=one_each), estimator(SCORES, GROUP), msg=name
        )


def test_reinforce_pp_hand_values():
    # gamma 1: returns [[1, 1], [0.5, -]]; over 3 real tokens mean 5/6, variance 1/18
    rewards = torch.tensor([[0.0, 1.0], [0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = rm.reinforce_pp_advantages(rewards, mask, gamma=1.0)
    s = math.sqrt(1 / 18)
    expected = torch.tensor([[(1 - 5 / 6) / s, (1 - 5 / 6) / s], [(0.5 - 5 / 6) / s, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_baseline_hand_values():
    # group means 1/2 and 1 -> centred [1/2, -1/2, 0, 0]; tokens: 1/2, 1/2 | -1/2 | 0 | 0, 0
    # over 6 tokens: mean 1/12, variance (2 (5/12)^2 + (7/12)^2 + 3 (1/12)^2) / 6 = 102/864
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    adv = rm.reinforce_pp_baseline_advantages(scores, group, mask)
    s = math.sqrt(102 / 864)
    up, down, zero = (5 / 12) / s, (-7 / 12) / s, (-1 / 12) / s
    expected = torch.tensor([[up, up], [down, 0.0], [zero, 0.0], [zero, zero]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- policy losses


def test_ppo_loss_hand_values_with_separate_low_and_high_clip():
    # ratios 1.5, 0.5, 0.7 with advantages +1, -1, +1, clip 1 - 0.2 .. 1 + 0.28:
    # token 0: max(-1.5, -1.28) = -1.28 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped);
    # token 2: max(-0.7, -0.8) = -0.7
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.7]]))
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, clipped = rm.ppo_token_loss(logp, torch.zeros(1, 3), adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8, -0.7]]))
    assert clipped.tolist() == [[True, True, False]]


def test_ppo_loss_gradient_is_zero_where_clipped():
    logp = torch.log(torch.tensor([[1.5, 0.9]])).requires_grad_()
    loss, _ = rm.ppo_token_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.9]]))  # d(-r)/dlogp = -r


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_far_token_ratio_is_clamped_not_a_nan(log_ratio, advantage):
    # exp(100) overflows float32 (past 88.7): unclamped, the loss is inf and its gradient
    # NaN, and the run stops. The log ratio is clamped to [-20, 20] as verl's is; beyond
    # that the token gives no gradient.
    logp = torch.tensor([[log_ratio]], requires_grad=True)
    adv = torch.tensor([[advantage]])
    for kind in POLICY_LOSSES:
        loss, _ = POLICY_LOSSES[kind].token_loss(
            logp, torch.zeros(1, 1), adv, torch.ones(1, 1), 0.2, 0.2
        )
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), kind
    loss, _ = rm.ppo_token_loss(logp, torch.zeros(1, 1), adv, 0.2, 0.2)
    # ratio e^20 (or e^-20); the loss is the larger of -A r and -A clip(r, 0.8, 1.2)
    ratio = math.exp(math.copysign(20.0, log_ratio))
    expected = max(-advantage * ratio, -advantage * min(max(ratio, 0.8), 1.2))
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_gspo_uses_the_geometric_mean_ratio_of_the_sequence():
    # token ratios 1.2 and 0.8 -> sequence ratio sqrt(0.96); padding (ratio 50) ignored
    logp = torch.log(torch.tensor([[1.2, 0.8, 50.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    s = math.sqrt(0.96)
    loss, clipped = rm.gspo_token_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), mask, 0.1, 0.1)
    torch.testing.assert_close(loss[:, :2], torch.tensor([[-s, -s]]))
    assert clipped[:, :2].tolist() == [[False, False]]
    # Outside [1 - 3e-4, 1 + 4e-4] with a positive advantage the clip holds the loss at 1 + 4e-4.
    up = torch.log(torch.tensor([[1.1, 1.1, 1.0]]))
    loss, clipped = rm.gspo_token_loss(up, torch.zeros(1, 3), torch.ones(1, 3), mask, 3e-4, 4e-4)
    torch.testing.assert_close(loss[:, :2], torch.tensor([[-(1 + 4e-4)] * 2]))
    assert clipped[:, :2].tolist() == [[True, True]]


def test_gspo_token_gradient_equals_the_sequence_objective_gradient():
    # With one advantage per sequence and each sequence's tokens averaged, GSPO-token's
    # gradient is GSPO's: d/dtheta of -A * exp(mean_t (logp - old)).
    torch.manual_seed(2)
    logp = (torch.randn(3, 4) * 0.01).requires_grad_()
    old = torch.randn(3, 4) * 0.01
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None].expand(3, 4)
    loss, _ = rm.gspo_token_loss(logp, old, adv, mask, clip_low=1.0, clip_high=10.0)
    (token_grad,) = torch.autograd.grad(rm.aggregate(loss, mask, "seq_mean_token_mean"), logp)
    ratio = torch.exp(rm.sequence_mean(logp - old, mask))
    (seq_grad,) = torch.autograd.grad((-adv[:, 0] * ratio).mean(), logp)
    torch.testing.assert_close(token_grad, seq_grad)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # ratios 1.5 and 6 with clip_high 4: weights 1.5 and 5; gradient -w * A wrt logp
    logp = torch.log(torch.tensor([[1.5, 6.0]])).requires_grad_()
    loss, clipped = rm.cispo_token_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), 1.0, 4.0)
    torch.testing.assert_close(loss, -torch.tensor([[1.5, 5.0]]) * logp.detach())
    assert clipped.tolist() == [[False, True]]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.5, -5.0]]))


def test_policy_losses_equal_on_policy_at_ratio_one():
    # Before the first update (ratio 1) every loss has the REINFORCE gradient -A dlogp.
    torch.manual_seed(3)
    logp = torch.randn(2, 3).requires_grad_()
    adv = torch.randn(2, 3)
    mask = torch.ones(2, 3)
    for kind in POLICY_LOSSES:
        loss, _ = POLICY_LOSSES[kind].token_loss(logp, logp.detach(), adv, mask, 0.2, 0.2)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        torch.testing.assert_close(grad, -adv, msg=kind)


# ---------------------------------------------------------------- aggregation

TOKEN_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
TOKEN_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 10 / 4),  # every token alike
        ("seq_mean_token_mean", (2 + 4) / 2),  # each sequence's mean, averaged
        ("seq_mean_token_sum", (6 + 4) / 2),
        ("seq_mean_token_sum_norm", 10 / (2 * 3)),  # max_length 3
    ],
)
def test_aggregation_hand_values(mode, expected):
    assert rm.aggregate(TOKEN_LOSS, TOKEN_MASK, mode, max_length=3).item() == pytest.approx(
        expected
    )


@pytest.mark.parametrize("mode", rm.LOSS_AGGREGATIONS)
def test_aggregation_ignores_padding(mode):
    garbage = TOKEN_LOSS.clone()
    garbage[1, 1:] = torch.tensor([float("nan"), 1e9])
    clean = rm.aggregate(TOKEN_LOSS, TOKEN_MASK, mode, max_length=3)
    assert rm.aggregate(garbage, TOKEN_MASK, mode, max_length=3).item() == clean.item()


@pytest.mark.parametrize("kind", POLICY_LOSSES)
@pytest.mark.parametrize("mode", rm.LOSS_AGGREGATIONS)
def test_two_micro_batches_give_the_same_gradient_as_one_batch(kind, mode):
    torch.manual_seed(0)
    weight = torch.randn(4, requires_grad=True)
    features = torch.randn(6, 3, 4)
    old = torch.randn(6, 3) * 0.1
    adv = torch.randn(6, 3)
    mask = torch.ones(6, 3)
    mask[1, 2:] = 0
    mask[4, 1:] = 0
    tokens, sequences = mask.sum().item(), 6.0

    def loss_of(rows, whole: bool):
        logp = (features[rows] @ weight) * 0.1
        loss, _ = POLICY_LOSSES[kind].token_loss(logp, old[rows], adv[rows], mask[rows], 0.2, 0.3)
        if whole:
            return rm.aggregate(loss, mask[rows], mode, max_length=3)
        # A micro-batch is given its mini-batch's counts.
        return rm.aggregate(loss, mask[rows], mode, tokens, sequences, 3, sequences)

    (full_grad,) = torch.autograd.grad(loss_of(slice(0, 6), whole=True), weight)
    micro = loss_of(slice(0, 2), whole=False) + loss_of(slice(2, 6), whole=False)
    (micro_grad,) = torch.autograd.grad(micro, weight)
    torch.testing.assert_close(micro_grad, full_grad)


def test_seq_mean_token_mean_weighs_sequences_not_tokens():
    # A long sequence counts as much as a short one: doubling its length changes nothing.
    short = rm.aggregate(
        torch.tensor([[1.0, 1.0], [3.0, 0.0]]),
        torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        "seq_mean_token_mean",
    )
    longer = rm.aggregate(
        torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]]),
        torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]),
        "seq_mean_token_mean",
    )
    assert short.item() == longer.item() == 2.0


def test_dr_grpo_divides_by_every_sampled_sequence_masked_or_not():
    # Masking a sequence out of the loss (a truncated one, mask_truncated) leaves the
    # normaliser G * max_length = 2 * 3: the other sequence's tokens keep their weight.
    mask = TOKEN_MASK.clone()
    mask[1] = 0.0
    loss = rm.aggregate(TOKEN_LOSS, mask, "seq_mean_token_sum_norm", max_length=3)
    assert loss.item() == pytest.approx(6 / (2 * 3))
    # A micro-batch of the first row is given its mini-batch's count.
    micro = rm.aggregate(
        TOKEN_LOSS[:1], mask[:1], "seq_mean_token_sum_norm", 3.0, 1.0, 3, sampled_sequences=2.0
    )
    assert micro.item() == pytest.approx(6 / (2 * 3))


# ---------------------------------------------------------------- value loss, KL, entropy


def test_value_loss_hand_values():
    # V=1.0, V_old=0.5, R=2.0, clip 0.2: clipped V = 0.7; errors 1.0 and 1.69 -> 0.5 * 1.69
    loss, clipped = rm.value_token_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]), 0.2
    )
    assert loss.item() == pytest.approx(0.845)
    assert clipped.tolist() == [[True]]


def test_kl_estimators_hand_values():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    assert rm.kl_estimate(logp, ref, "k1").item() == pytest.approx(LN2)
    assert rm.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * LN2**2)
    # q/p = 0.5: 0.5 - 1 - log(0.5) = log 2 - 0.5
    assert rm.kl_estimate(logp, ref, "k3").item() == pytest.approx(LN2 - 0.5)
    assert rm.kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        rm.kl_estimate(logp, ref, "k4")


def test_k3_is_clamped_so_one_far_token_cannot_decide_the_update():
    # At log r = -20, k3 = e^20 - 21 = 4.85e8 and its gradient -4.85e8: one token would
    # outweigh the batch. The log ratio is clamped to [-20, 20] and k3 to at most 10, as
    # verl's low_var_kl is; near the reference nothing changes.
    logp = torch.tensor([-20.0, -1.0, 0.5], requires_grad=True)
    k3 = rm.kl_estimate(logp, torch.zeros(3), "k3")
    torch.testing.assert_close(k3, torch.tensor([10.0, math.e - 2.0, math.exp(-0.5) - 0.5]))
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([0.0, 1.0 - math.e, 1.0 - math.exp(-0.5)]))


def test_kl_loss_expected_gradients_k1_zero_k2_forward_k3_reverse():
    # Exact expectations over a 3-way categorical p = softmax(theta) with samples y ~ p:
    # E[grad k1(y)] = 0 (why k1 is refused in loss mode), E[grad k2] = grad KL(p || q),
    # E[grad k3] = grad KL(q || p).
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    ref_logq = torch.log_softmax(torch.tensor([0.0, 0.4, -0.1]), dim=0)

    def expected_grad(estimator: str) -> torch.Tensor:
        logp = torch.log_softmax(theta, dim=0)
        weights = logp.exp().detach()  # sampling distribution: no gradient through it
        kl = rm.kl_estimate(logp, ref_logq, estimator)
        (grad,) = torch.autograd.grad((weights * kl).sum(), theta)
        return grad

    def kl_grad(forward: bool) -> torch.Tensor:
        logp = torch.log_softmax(theta, dim=0)
        p, q = logp.exp(), ref_logq.exp()
        kl = (p * (logp - ref_logq)).sum() if forward else (q * (ref_logq - logp)).sum()
        (grad,) = torch.autograd.grad(kl, theta)
        return grad

    torch.testing.assert_close(expected_grad("k1"), torch.zeros(3))
    torch.testing.assert_close(expected_grad("k2"), kl_grad(forward=True))
    torch.testing.assert_close(expected_grad("k3"), kl_grad(forward=False))


def test_token_logprobs_equal_log_softmax_gather():
    torch.manual_seed(4)
    logits = torch.randn(2, 3, 7) * 5
    tokens = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(rm.token_logprobs(logits, tokens), expected)


def test_entropy_of_uniform_logits_is_log_vocab():
    entropy = rm.entropy_from_logits(torch.zeros(2, 3, 4))
    torch.testing.assert_close(entropy, torch.full((2, 3), math.log(4)))


def test_explained_variance_perfect_and_useless():
    returns = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3)
    assert rm.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert rm.explained_variance(torch.full((1, 3), 2.0), returns, mask) == pytest.approx(0.0)


# ---------------------------------------------------------------- rollout correction


def test_rollout_correction_hand_values():
    # learner/vLLM ratios 1.5, 3, 0.5 (and padding): token weights truncated at 2
    old = torch.log(torch.tensor([[1.5, 3.0, 0.5, 99.0]]))
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    token = rm.rollout_correction_weights(old, rollout, mask, "token", clip=2.0)
    torch.testing.assert_close(token[:, :3], torch.tensor([[1.5, 2.0, 0.5]]))
    # sequence: 1.5 * 3 * 0.5 = 2.25 -> truncated at 2, the same on every token
    sequence = rm.rollout_correction_weights(old, rollout, mask, "sequence", clip=2.0)
    torch.testing.assert_close(sequence, torch.full((1, 4), 2.0))
    sequence = rm.rollout_correction_weights(old, rollout, mask, "sequence", clip=3.0)
    torch.testing.assert_close(sequence, torch.full((1, 4), 2.25))
    assert rm.rollout_correction_weights(old, rollout, mask, "off", 2.0).eq(1).all()


def test_geometric_rollout_correction_is_the_truncated_geometric_mean_of_token_ratios():
    # Row 0: ratios 2 and 1 -> sqrt(2) on both tokens (padding's 99 left out);
    # row 1: ratios 4, 4, 4 -> 4, truncated at 2; row 2: ratios 0.5 and 0.125 -> 0.25.
    old = torch.log(torch.tensor([[2.0, 1.0, 99.0], [4.0, 4.0, 4.0], [0.5, 0.125, 7.0]]))
    rollout = torch.zeros(3, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = rm.rollout_correction_weights(old, rollout, mask, "geometric", clip=2.0)
    expected = torch.tensor([[math.sqrt(2.0)] * 3, [2.0] * 3, [0.25] * 3])
    torch.testing.assert_close(weights, expected)
    # A sequence's length does not compound its weight, as it does at "sequence" level.
    doubled = torch.cat([old[:1, :2], old[:1, :2]], dim=1)
    again = rm.rollout_correction_weights(
        doubled, torch.zeros(1, 4), torch.ones(1, 4), "geometric", 2.0
    )
    torch.testing.assert_close(again, torch.full((1, 4), math.sqrt(2.0)))


def test_logprob_mismatch_hand_values():
    old = torch.tensor([[0.1, -0.8, 0.0, 5.0]])
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    mismatch = rm.logprob_mismatch(old, rollout, mask)
    assert mismatch["mean"].item() == pytest.approx(0.3)
    assert mismatch["max"].item() == pytest.approx(0.8)
    assert mismatch["outside_share"].item() == pytest.approx(1 / 3)  # only |0.8| > log 2


# ---------------------------------------------------------------- devices


# ---------------------------------------------------------------- preference losses


def test_preference_margin_is_the_policys_gain_over_the_reference():
    # chosen: policy -2, reference -3 (+1); rejected: policy -5, reference -4 (-1): h = 2
    h = rm.preference_margins(
        torch.tensor([-2.0]), torch.tensor([-5.0]), torch.tensor([-3.0]), torch.tensor([-4.0])
    )
    torch.testing.assert_close(h, torch.tensor([2.0]))


def test_dpo_loss_hand_values():
    h = torch.tensor([math.log(3.0), 0.0, -math.log(3.0)])
    # beta 1: sigmoid(ln 3) = 3/4, sigmoid(0) = 1/2, sigmoid(-ln 3) = 1/4
    want = torch.tensor([-math.log(0.75), LN2, -math.log(0.25)])
    torch.testing.assert_close(rm.dpo_loss(h, beta=1.0), want)
    # beta 0.5 on 2h is beta 1 on h
    torch.testing.assert_close(rm.dpo_loss(2 * h, beta=0.5), want)
    # label smoothing 0.1: 0.9 (-ln 3/4) + 0.1 (-ln 1/4) = 0.258914 + 0.138629
    smoothed = rm.dpo_loss(h[:1], beta=1.0, label_smoothing=0.1)
    torch.testing.assert_close(smoothed, torch.tensor([0.397543]), atol=1e-6, rtol=0)


def test_dpo_loss_invariances_and_gradient():
    h = torch.tensor([-1.3, 0.2, 2.5], requires_grad=True)
    # Smoothing 0.5 cannot tell chosen from rejected: the loss is even in h.
    torch.testing.assert_close(rm.dpo_loss(h, 0.7, 0.5), rm.dpo_loss(-h, 0.7, 0.5))
    # d/dh -log sigmoid(beta h) = -beta sigmoid(-beta h): always raises the margin,
    # most where the pair is ranked wrong.
    rm.dpo_loss(h, beta=0.7).sum().backward()
    torch.testing.assert_close(h.grad, -0.7 * torch.sigmoid(-0.7 * h.detach()))
    assert h.grad[0].abs() > h.grad[2].abs()
    # The same constant added to a completion's policy and reference logprobs (a
    # shared prefix, say) changes nothing.
    args = [torch.tensor([-2.0]), torch.tensor([-5.0]), torch.tensor([-3.0]), torch.tensor([-4.0])]
    shifted = [args[0] + 7, args[1] - 2, args[2] + 7, args[3] - 2]
    torch.testing.assert_close(rm.preference_margins(*shifted), rm.preference_margins(*args))


def test_ipo_loss_hand_values():
    # beta 0.5: target 1 / (2 beta) = 1; h = 3 -> 4, h = 1 -> 0, h = -1 -> 4
    torch.testing.assert_close(
        rm.ipo_loss(torch.tensor([3.0, 1.0, -1.0]), beta=0.5), torch.tensor([4.0, 0.0, 4.0])
    )


def test_implicit_rewards_and_bradley_terry_hand_values():
    rewards = rm.implicit_rewards(torch.tensor([-2.0, -6.0]), torch.tensor([-3.0, -4.0]), 0.1)
    torch.testing.assert_close(rewards, torch.tensor([0.1, -0.2]))
    # r_w - r_l = ln 3: -ln 3/4; equal scores: ln 2; only the difference counts
    loss = rm.bradley_terry_loss(torch.tensor([math.log(3.0), 5.0]), torch.tensor([0.0, 5.0]))
    torch.testing.assert_close(loss, torch.tensor([-math.log(0.75), LN2]))
    shifted = rm.bradley_terry_loss(torch.tensor([math.log(3.0) + 9]), torch.tensor([9.0]))
    torch.testing.assert_close(shifted, loss[:1])


def test_the_centring_term_adds_the_squared_sum_of_a_pairs_scores():
    chosen, rejected = torch.tensor([math.log(3.0), 2.0]), torch.tensor([0.0, -2.0])
    plain = rm.bradley_terry_loss(chosen, rejected)
    # ln 3 + 0 = ln 3: 0.5 (ln 3)^2 more; 2 + (-2) = 0: nothing more (centred already)
    centred = rm.bradley_terry_loss(chosen, rejected, center_coef=0.5)
    torch.testing.assert_close(centred, plain + torch.tensor([0.5 * math.log(3.0) ** 2, 0.0]))
    # A shift of both scores leaves the likelihood and moves the centring term only.
    moved = rm.bradley_terry_loss(chosen + 1, rejected + 1, center_coef=0.5)
    torch.testing.assert_close(moved - plain, 0.5 * (chosen + rejected + 2) ** 2)


def test_every_function_makes_its_tensors_on_the_inputs_device():
    # On the meta device any tensor made on the CPU (not a 0-dim scalar) raises when it
    # meets the inputs; no data is needed to run the math there.
    meta = torch.device("meta")
    b, t = 4, 3
    x = torch.empty(b, t, device=meta)
    mask = torch.empty(b, t, device=meta)
    scores = torch.empty(b, device=meta)
    group = torch.zeros(b, dtype=torch.long, device=meta)
    outputs = [
        *rm.gae(x, x, mask, 0.9, 0.9),
        rm.discounted_returns(x, mask, 0.9),
        rm.token_rewards(scores, x, mask, 0.1),
        rm.masked_whiten(x, mask),
        rm.masked_mean(x, mask, denominator=5.0),
        rm.grpo_advantages(scores, group),
        rm.dr_grpo_advantages(scores, group),
        rm.rloo_advantages(scores, group),
        rm.reinforce_pp_advantages(x, mask, 1.0),
        rm.reinforce_pp_baseline_advantages(scores, group, mask),
        *rm.value_token_loss(x, x, x, 0.2),
        rm.token_logprobs(
            torch.empty(b, t, 5, device=meta), torch.zeros(b, t, dtype=torch.long, device=meta)
        ),
        rm.entropy_from_logits(torch.empty(b, t, 5, device=meta)),
        *rm.logprob_mismatch(x, x, mask).values(),
        rm.dpo_loss(rm.preference_margins(scores, scores, scores, scores), 0.1, 0.1),
        rm.ipo_loss(scores, 0.1),
        rm.implicit_rewards(scores, scores, 0.1),
        rm.bradley_terry_loss(scores, scores),
    ]
    for kind in POLICY_LOSSES:
        outputs.extend(POLICY_LOSSES[kind].token_loss(x, x, x, mask, 0.2, 0.2))
    for mode in rm.LOSS_AGGREGATIONS:
        outputs.append(rm.aggregate(x, mask, mode, 10.0, 4.0, 3, sampled_sequences=4.0))
        outputs.append(rm.aggregate(x, mask, mode, max_length=3))
    for level in rm.ROLLOUT_CORRECTIONS:
        outputs.append(rm.rollout_correction_weights(x, x, mask, level, 2.0))
    for estimator in rm.KL_ESTIMATORS:
        outputs.append(rm.kl_estimate(x, x, estimator))
    assert all(out.device == meta for out in outputs)


def test_math_on_the_test_device_equals_the_math_on_the_cpu(device):
    if device == "cpu":
        pytest.skip("compares --device with the CPU: run with --device cuda on a GPU machine")
    torch.manual_seed(5)
    b, t = 6, 5
    mask = (torch.rand(b, t) > 0.3).float()
    inputs = {
        "x": torch.randn(b, t),
        "y": torch.randn(b, t) * 0.1,
        "mask": mask,
        "scores": torch.rand(b),
        "group": torch.tensor([0, 0, 1, 1, 2, 2]),
        "logits": torch.randn(b, t, 9),
        "tokens": torch.randint(0, 9, (b, t)),
    }

    def run(v: dict) -> list[torch.Tensor]:
        out = [
            *rm.gae(v["x"], v["y"], v["mask"], 0.9, 0.95),
            rm.grpo_advantages(v["scores"], v["group"]),
            rm.rloo_advantages(v["scores"], v["group"]),
            rm.reinforce_pp_baseline_advantages(v["scores"], v["group"], v["mask"]),
            rm.token_logprobs(v["logits"], v["tokens"]),
            rm.rollout_correction_weights(v["y"], v["x"] * 0.1, v["mask"], "sequence", 2.0),
            rm.rollout_correction_weights(v["y"], v["x"] * 0.1, v["mask"], "geometric", 2.0),
            rm.kl_estimate(v["x"] * 10, v["y"], "k3"),  # some past its clamps
        ]
        for kind in POLICY_LOSSES:
            loss, _ = POLICY_LOSSES[kind].token_loss(
                v["y"], v["y"] * 0.5, v["x"], v["mask"], 0.2, 0.3
            )
            out += [
                rm.aggregate(loss, v["mask"], mode, max_length=t) for mode in rm.LOSS_AGGREGATIONS
            ]
        return out

    on_cpu = run(inputs)
    on_device = run({k: v.to(device) for k, v in inputs.items()})
    for a, b_ in zip(on_cpu, on_device, strict=True):
        assert b_.device.type == torch.device(device).type
        torch.testing.assert_close(b_.cpu(), a, atol=1e-5, rtol=1e-4)


def test_check_finite_names_the_first_bad_value_and_ignores_padding(device):
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], device=device)
    with pytest.raises(rm.NonFiniteError, match=r"^advantages is not finite \(nan at \[0, 1\]\)$"):
        rm.check_finite("advantages", x)
    padding = torch.tensor([[1.0, 1.0], [0.0, 1.0]], device=device)
    with pytest.raises(rm.NonFiniteError, match=r"\(nan at \[0, 1\]\)"):
        rm.check_finite("advantages", x, padding)
    rm.check_finite("advantages", x, torch.tensor([[1.0, 0.0], [0.0, 1.0]], device=device))
    with pytest.raises(rm.NonFiniteError, match=r"^loss is not finite \(inf at \[\]\)$"):
        rm.check_finite("loss", torch.tensor(float("inf"), device=device))
