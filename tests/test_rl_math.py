"""The PPO math against values worked out by hand, and its invariances."""

import math

import pytest
import torch

from rlray import ppo_math as pm


def test_gae_matches_three_step_hand_computation():
    # gamma=0.9, lam=0.8, V=[0.5, 0.6, 0.7], r=[0, 0, 1]:
    # d2 = 1 - 0.7 = 0.3;            A2 = 0.3
    # d1 = 0.9*0.7 - 0.6 = 0.03;     A1 = 0.03 + 0.72*0.3   = 0.246
    # d0 = 0.9*0.6 - 0.5 = 0.04;     A0 = 0.04 + 0.72*0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = pm.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]))


def test_gae_padded_positions_change_nothing():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    clean_adv, clean_ret = pm.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    garbage_rewards = rewards.clone()
    garbage_rewards[0, 3:] = torch.tensor([7.0, float("nan")])
    garbage_values = values.clone()
    garbage_values[0, 3:] = torch.tensor([-3.0, float("inf")])
    adv, ret = pm.gae(garbage_rewards, garbage_values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, clean_adv)
    torch.testing.assert_close(ret, clean_ret)
    assert adv[0, 3:].tolist() == [0.0, 0.0]


def test_gae_vectorised_over_batch_equals_per_episode_loop():
    torch.manual_seed(0)
    lengths = [5, 2, 4]
    rewards = torch.randn(3, 5)
    values = torch.randn(3, 5)
    mask = torch.zeros(3, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    adv, _ = pm.gae(rewards, values, mask, gamma=0.95, lam=0.9)
    for i, n in enumerate(lengths):
        expected, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_value = values[i, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[i, t].item() + 0.95 * next_value - values[i, t].item()
            running = delta + 0.95 * 0.9 * running
            expected[t] = running
        torch.testing.assert_close(adv[i, :n], torch.tensor(expected))


def test_masked_whiten_hand_values_and_zero_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, variance 2/3 -> (x - 2) / sqrt(2/3)
    s = math.sqrt(1.5)
    torch.testing.assert_close(pm.masked_whiten(x, mask), torch.tensor([[-s, 0.0, s, 0.0]]))


def test_policy_loss_hand_values():
    # ratios 1.5, 0.5, 0.5 with advantages +1, +1, -1 and clip 0.2:
    # token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(-0.5, -0.8) = -0.5;
    # token 3: max(0.5, 0.8) = 0.8 (clipped) -> loss = (-1.2 - 0.5 + 0.8) / 3 = -0.3
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, clip_fraction = pm.policy_loss(logp, old, adv, torch.ones(1, 3), clip=0.2)
    assert loss.item() == pytest.approx(-0.3)
    assert clip_fraction.item() == pytest.approx(2 / 3)


def test_policy_loss_ignores_padding():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 9.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, _ = pm.policy_loss(logp, old, adv, mask, clip=0.2)
    assert loss.item() == pytest.approx(-0.3)


def test_value_loss_hand_values():
    # V=1.0, V_old=0.5, R=2.0, clip 0.2: clipped V = 0.7; errors 1.0 and 1.69 -> 0.5 * 1.69
    loss, clip_fraction = pm.value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1), 0.2
    )
    assert loss.item() == pytest.approx(0.845)
    assert clip_fraction.item() == 1.0


def test_kl_estimators_hand_values():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    assert pm.kl_estimate(logp, ref, "k1").item() == pytest.approx(math.log(2))
    # q/p = 0.5: 0.5 - 1 - log(0.5) = log 2 - 0.5
    assert pm.kl_estimate(logp, ref, "k3").item() == pytest.approx(math.log(2) - 0.5)
    assert pm.kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k2"):
        pm.kl_estimate(logp, ref, "k2")


def test_token_rewards_put_score_on_last_real_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards = pm.token_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [1.75, 0.0, 0.0]]))


def test_entropy_of_uniform_logits_is_log_vocab():
    entropy = pm.entropy_from_logits(torch.zeros(2, 3, 4))
    torch.testing.assert_close(entropy, torch.full((2, 3), math.log(4)))


def test_explained_variance_perfect_and_useless():
    returns = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3)
    assert pm.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert pm.explained_variance(torch.full((1, 3), 2.0), returns, mask) == pytest.approx(0.0)


def test_two_micro_batches_give_the_same_gradient_as_one_batch():
    torch.manual_seed(0)
    weight = torch.randn(4, requires_grad=True)
    features = torch.randn(6, 3, 4)
    old = torch.randn(6, 3) * 0.1
    adv = torch.randn(6, 3)
    mask = torch.ones(6, 3)
    mask[1, 2:] = 0
    mask[4, 1:] = 0

    def loss_of(rows, token_count=None):
        logp = (features[rows] @ weight) * 0.1
        return pm.policy_loss(logp, old[rows], adv[rows], mask[rows], 0.2, token_count)[0]

    (full_grad,) = torch.autograd.grad(loss_of(slice(0, 6)), weight)
    total = mask.sum().item()
    micro = loss_of(slice(0, 3), total) + loss_of(slice(3, 6), total)
    (micro_grad,) = torch.autograd.grad(micro, weight)
    torch.testing.assert_close(micro_grad, full_grad)
