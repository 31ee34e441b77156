"""The Algorithm object: built from the config's numbers, every choice implemented once,
KL in the reward reaching every estimator, truncated completions masked, and the loss's
terms present only when their coefficients are, each aggregated as the policy loss is.
Off the default path: a KL penalty in the reward only where it is one, GSPO's own
aggregation and rollout correction, and Dr. GRPO's constant normaliser."""

import typing

import pytest
import torch

from rlray.algorithms import rl_math as rm
from rlray.algorithms.algorithm import Algorithm, MicroBatch, StepInputs
from rlray.algorithms.estimators import ESTIMATORS
from rlray.algorithms.losses import POLICY_LOSSES
from rlray.config import (
    AlgorithmConfig,
    Config,
    ConfigError,
    validate,
)
from rlray.config.command_line import build_parser, parse_command_line
from rlray.config.schema import KLEstimator, LossAggregation, RolloutCorrection


def test_every_registered_choice_is_offered_and_explained_by_the_command_line():
    parser = build_parser()
    for field, registry in (("advantage", ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
        (action,) = [a for a in parser._actions if f"--algorithm.{field}" in a.option_strings]
        assert all(
            f"{name} = {entry.summary.rstrip('.')}" in action.help
            for name, entry in registry.items()
        )
        with pytest.raises(ConfigError) as refused:
            parse_command_line([f"--algorithm.{field}", "nope"])
        assert str(refused.value).startswith(
            f"algorithm.{field} must be one of {', '.join(registry)};"
        )
    assert {n for n, e in ESTIMATORS.items() if e.needs_critic} == {"gae"}
    assert {n for n, e in ESTIMATORS.items() if e.compares_groups} == {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp_baseline",
    }


def test_every_config_choice_has_exactly_one_implementation():
    assert set(typing.get_args(LossAggregation)) == set(rm.LOSS_AGGREGATIONS)
    assert set(typing.get_args(KLEstimator)) == set(rm.KL_ESTIMATORS)
    assert set(typing.get_args(RolloutCorrection)) == set(rm.ROLLOUT_CORRECTIONS)
    for loss in POLICY_LOSSES.values():  # their defaults are choices the config offers
        assert loss.aggregation in rm.LOSS_AGGREGATIONS, loss.name
        assert loss.rollout_correction in rm.ROLLOUT_CORRECTIONS, loss.name


@pytest.mark.parametrize(
    ("loss", "low", "high", "expected"),
    [
        ("ppo", None, None, (0.2, 0.2)),
        ("ppo", None, 0.28, (0.2, 0.28)),  # DAPO clip-higher
        ("gspo", None, None, (3e-4, 4e-4)),
        ("cispo", None, None, (1.0, 4.0)),
        ("cispo", 0.5, 1.0, (0.5, 1.0)),
    ],
)
def test_clips_default_to_each_policy_loss_own(loss, low, high, expected):
    config = AlgorithmConfig(policy_loss=loss, clip_low=low, clip_high=high)
    algorithm = Algorithm(config, max_length=6)
    assert (algorithm.clip_low, algorithm.clip_high) == expected
    assert algorithm.max_length == 6


def step_inputs(**changes) -> StepInputs:
    values = {
        "rewards": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "group": torch.tensor([0, 0, 1, 1]),
        "sample": torch.tensor([0, 1, 2, 3]),
        "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]]),
        "old_logp": torch.zeros(4, 2),
        "ref_logp": None,
        "values": None,
    }
    return StepInputs(**{**values, **changes})


def test_group_advantages_are_broadcast_over_real_tokens_only():
    adv = Algorithm(AlgorithmConfig(advantage="dr_grpo")).advantages(step_inputs()).advantages
    # group 0 is uniform (both 1): 0; group 1: 0 - 1/2 and 1 - 1/2
    torch.testing.assert_close(
        adv, torch.tensor([[0.0, 0.0], [0.0, 0.0], [-0.5, -0.5], [0.5, 0.0]])
    )


def test_kl_in_the_reward_reaches_group_estimators():
    # Episode 0's two tokens have KL 0.1 each (k1: old - ref); coefficient 0.5 takes 0.1
    # off its score: group 0's scores become 0.9 and 1.0 -> dr_grpo -0.05 and +0.05.
    ref = torch.zeros(4, 2)
    ref[0] = -0.1
    algorithm = Algorithm(AlgorithmConfig(advantage="dr_grpo", kl_coef=0.5, kl_estimator="k1"))
    result = algorithm.advantages(step_inputs(ref_logp=ref))
    torch.testing.assert_close(result.advantages[:2], torch.tensor([[-0.05, -0.05], [0.05, 0.0]]))
    # In loss mode the reward is untouched: the uniform group stays at 0.
    loss_mode = Algorithm(
        AlgorithmConfig(advantage="dr_grpo", kl_coef=0.5, kl_estimator="k3", kl_mode="loss")
    )
    assert loss_mode.advantages(step_inputs(ref_logp=ref)).advantages[:2].abs().max() == 0


def test_gae_needs_values_and_gives_returns():
    algorithm = Algorithm(
        AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    )
    result = algorithm.advantages(step_inputs(values=torch.full((4, 2), 0.25)))
    # lambda 1, gamma 1: A_t = R - V_t, returns = R on every real token
    torch.testing.assert_close(result.returns[0], torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(result.advantages[2], torch.tensor([-0.25, -0.25]))
    with pytest.raises(ValueError, match="critic"):
        algorithm.advantages(step_inputs())


def test_truncated_completions_leave_the_loss_only_when_asked():
    mask = torch.ones(3, 2)
    truncated = torch.tensor([False, True, False])
    assert Algorithm(AlgorithmConfig()).loss_mask(mask, truncated).sum() == 6
    masked = Algorithm(AlgorithmConfig(mask_truncated=True)).loss_mask(mask, truncated)
    assert masked.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]


def micro_batch(entropy: torch.Tensor, **changes) -> MicroBatch:
    values = {
        "logp": torch.zeros(2, 2, requires_grad=True),
        "mask": torch.ones(2, 2),
        "old_logp": torch.zeros(2, 2),
        "advantages": torch.tensor([[1.0, 1.0], [-1.0, -1.0]]),
        "correction": torch.ones(2, 2),
        "entropy": entropy,
    }
    return MicroBatch(**{**values, **changes})


def test_entropy_enters_the_loss_only_with_a_coefficient():
    entropy = torch.full((2, 2), 0.7, requires_grad=True)
    loss, metrics = Algorithm(AlgorithmConfig()).loss(micro_batch(entropy), 4.0, 2.0, 2.0)
    assert metrics["entropy"] == pytest.approx(0.7)
    assert (
        not loss.requires_grad or torch.autograd.grad(loss, entropy, allow_unused=True)[0] is None
    )
    loss, _ = Algorithm(AlgorithmConfig(entropy_coef=0.1)).loss(micro_batch(entropy), 4.0, 2.0, 2.0)
    (grad,) = torch.autograd.grad(loss, entropy)
    torch.testing.assert_close(grad, torch.full((2, 2), -0.1 / 4))


def test_rollout_correction_weights_scale_the_policy_loss():
    # Advantages +1 on both rows at ratio 1: token loss -1 each, weighted 2 and 0.5.
    entropy = torch.zeros(2, 2)
    plain = micro_batch(entropy, advantages=torch.ones(2, 2))
    weighted = micro_batch(
        entropy, advantages=torch.ones(2, 2), correction=torch.tensor([[2.0, 2.0], [0.5, 0.5]])
    )
    assert Algorithm(AlgorithmConfig()).loss(plain, 4.0, 2.0, 2.0)[0].item() == pytest.approx(-1.0)
    assert Algorithm(AlgorithmConfig()).loss(weighted, 4.0, 2.0, 2.0)[0].item() == pytest.approx(
        -1.25
    )


# ---------------------------------------------------------------- the review's off-default paths


def policy_micro_batch(
    logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor
) -> MicroBatch:
    """Returns a micro-batch at ratio 1 and correction weight 1, without entropy."""
    ones = torch.ones_like(mask)
    return MicroBatch(logp, mask, logp.detach().clone(), advantages, ones)


def reward_mode_accepts(estimator: str) -> bool:
    """Returns whether the config's checks take `estimator` for a KL penalty in the reward."""
    config = Config()
    config.algorithm.kl_coef, config.algorithm.kl_mode = 0.05, "reward"
    config.algorithm.kl_estimator = estimator
    try:
        validate(config)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("estimator", rm.KL_ESTIMATORS)
def test_a_kl_penalty_in_the_reward_has_the_kls_gradient_for_every_estimator_accepted(estimator):
    # In the reward, an estimator k is a penalty -kl_coef * k(y) on a sample y ~ p that
    # the policy gradient multiplies by grad log p(y): its expected gradient is
    # E_p[k(y) grad log p(y)], exact here over a 3-way categorical. That is grad KL(p || q)
    # for k1 only; for k3 it is grad KL(p || q) - grad KL(q || p), which may point away
    # from the reference. So reward mode takes k1 and refuses the others.
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    logq = torch.log_softmax(torch.tensor([0.0, 0.4, -0.1]), dim=0)
    logp = torch.log_softmax(theta, dim=0)
    p = logp.exp().detach()
    k = rm.kl_estimate(logp.detach(), logq, estimator)  # a reward: no gradient of its own
    (expected,) = torch.autograd.grad((p * k * logp).sum(), theta, retain_graph=True)
    (kl_grad,) = torch.autograd.grad((logp.exp() * (logp - logq)).sum(), theta)
    matches = torch.allclose(expected, kl_grad, atol=1e-6)
    assert matches == reward_mode_accepts(estimator), (estimator, expected, kl_grad)
    assert AlgorithmConfig().kl_estimator == "k1" and AlgorithmConfig().kl_mode == "reward"


def test_gspo_weighs_each_token_one_over_group_size_times_its_length():
    # GSPO's objective is the mean over the G sequences of each one's token mean: two
    # sequences of 8 and 2 tokens at ratio 1 with advantage 1 get per-token gradients
    # -1/(2*8) and -1/(2*2). token_mean would give both -1/10.
    mask = torch.zeros(2, 8)
    mask[0], mask[1, :2] = 1.0, 1.0
    gspo = Algorithm(AlgorithmConfig(policy_loss="gspo"), max_length=8)
    assert gspo.loss_aggregation == "seq_mean_token_mean"
    logp = torch.zeros(2, 8, requires_grad=True)
    micro = policy_micro_batch(logp, mask, advantages=mask.clone())
    loss, _ = gspo.loss(micro, 10.0, 2.0, 2.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0].item() == pytest.approx(-0.0625) and grad[1, 0].item() == pytest.approx(-0.25)
    assert grad[1, 2:].abs().sum() == 0
    # Told otherwise, GSPO aggregates as the user says.
    told = Algorithm(AlgorithmConfig(policy_loss="gspo", loss_aggregation="token_mean"))
    (grad,) = torch.autograd.grad(told.loss(micro, 10.0, 2.0, 2.0)[0], logp)
    assert grad[0, 0].item() == pytest.approx(-0.1) and grad[1, 0].item() == pytest.approx(-0.1)
    assert Algorithm(AlgorithmConfig()).loss_aggregation == "token_mean"


def test_gspo_corrects_for_the_rollout_at_sequence_level():
    # Learner/vLLM token ratios 2 and 1: GSPO's weight is their geometric mean sqrt(2) on
    # both tokens, as its ratio is; PPO's are the token ratios 2 and 1.
    old = torch.log(torch.tensor([[2.0, 1.0]]))
    rollout, mask = torch.zeros(1, 2), torch.ones(1, 2)
    gspo = Algorithm(AlgorithmConfig(policy_loss="gspo"))
    assert gspo.rollout_correction == "geometric"
    root2 = 2.0**0.5
    torch.testing.assert_close(
        gspo.correction_weights(old, rollout, mask), torch.tensor([[root2, root2]])
    )
    ppo = Algorithm(AlgorithmConfig())
    torch.testing.assert_close(
        ppo.correction_weights(old, rollout, mask), torch.tensor([[2.0, 1.0]])
    )
    told = Algorithm(AlgorithmConfig(policy_loss="gspo", rollout_correction="token"))
    torch.testing.assert_close(
        told.correction_weights(old, rollout, mask), torch.tensor([[2.0, 1.0]])
    )


def aggregation_weights(mode: str) -> torch.Tensor:
    """Returns the (2, 3) per-token weight of the policy loss under `mode`: the gradient
    of its loss at ratio 1 with advantage -1 on every token."""
    logp = torch.zeros(2, 3, requires_grad=True)
    micro = policy_micro_batch(logp, TWO_LENGTHS, advantages=-TWO_LENGTHS)
    algorithm = Algorithm(AlgorithmConfig(loss_aggregation=mode), max_length=3)
    (grad,) = torch.autograd.grad(algorithm.loss(micro, 4.0, 2.0, 2.0)[0], logp)
    return grad


TWO_LENGTHS = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # sequences of 3 and 1 tokens


@pytest.mark.parametrize("mode", rm.LOSS_AGGREGATIONS)
def test_kl_entropy_and_value_terms_weigh_tokens_as_the_policy_loss_does(mode):
    # Each term's per-token gradient is its coefficient times the policy loss's per-token
    # weight, in every mode: kl_coef and entropy_coef mean the same whatever the mode.
    weights = aggregation_weights(mode)
    hand = {
        "token_mean": [[1 / 4] * 3, [1 / 4, 0, 0]],
        "seq_mean_token_mean": [[1 / 6] * 3, [1 / 2, 0, 0]],
        "seq_mean_token_sum": [[1 / 2] * 3, [1 / 2, 0, 0]],
        "seq_mean_token_sum_norm": [[1 / 6] * 3, [1 / 6, 0, 0]],
    }
    torch.testing.assert_close(weights, torch.tensor(hand[mode]))
    settings = AlgorithmConfig(
        loss_aggregation=mode, kl_coef=0.5, kl_estimator="k2", kl_mode="loss", entropy_coef=0.1
    )
    settings.vf_coef = 2.0
    logp = torch.ones(2, 3, requires_grad=True)  # log ratio 1 to the reference: dk2 = 1
    entropy = torch.zeros(2, 3, requires_grad=True)
    values = torch.ones(2, 3, requires_grad=True)  # 1 above the returns: d(0.5 e^2) = 1
    micro = micro_batch(
        entropy,
        logp=logp,
        mask=TWO_LENGTHS,
        old_logp=torch.ones(2, 3),
        advantages=torch.zeros(2, 3),
        correction=torch.ones(2, 3),
        ref_logp=torch.zeros(2, 3),
        values=values,
        old_values=torch.ones(2, 3),
        returns=torch.zeros(2, 3),
    )
    loss, _ = Algorithm(settings, max_length=3).loss(micro, 4.0, 2.0, 2.0)
    kl_grad, entropy_grad, value_grad = torch.autograd.grad(loss, (logp, entropy, values))
    torch.testing.assert_close(kl_grad, 0.5 * weights)
    torch.testing.assert_close(entropy_grad, -0.1 * weights)
    torch.testing.assert_close(value_grad, 2.0 * weights)


def test_dr_grpo_normaliser_is_untouched_by_masking_truncated_completions():
    # Two sequences sampled, the second truncated and masked out of the loss: the first's
    # tokens keep the weight 1 / (G * max_length) = 1 / (2 * 3), not 1 / (1 * 3).
    settings = AlgorithmConfig(
        advantage="dr_grpo", loss_aggregation="seq_mean_token_sum_norm", mask_truncated=True
    )
    algorithm = Algorithm(settings, max_length=3)
    mask = algorithm.loss_mask(torch.ones(2, 3), torch.tensor([False, True]))
    logp = torch.zeros(2, 3, requires_grad=True)
    micro = policy_micro_batch(logp, mask, advantages=-torch.ones(2, 3))
    # The mini-batch: 3 tokens and 1 sequence in the loss, 2 sequences sampled.
    (grad,) = torch.autograd.grad(algorithm.loss(micro, 3.0, 1.0, 2.0)[0], logp)
    torch.testing.assert_close(grad, torch.tensor([[1 / 6] * 3, [0.0] * 3]))
