"""The Algorithm object: built from the config's numbers, every choice implemented once,
KL in the reward reaching every estimator, truncated completions masked, and the loss's
terms present only when their coefficients are."""

import typing

import pytest
import torch

from rlray.algorithms import rl_math as rm
from rlray.algorithms.algorithm import Algorithm, MicroBatch, StepInputs
from rlray.algorithms.estimators import ESTIMATORS
from rlray.algorithms.losses import POLICY_LOSSES
from rlray.config import AlgorithmConfig, ConfigError, build_parser, parse_command_line
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
    loss, metrics = Algorithm(AlgorithmConfig()).loss(micro_batch(entropy), 4.0, 2.0)
    assert metrics["entropy"] == pytest.approx(0.7)
    assert (
        not loss.requires_grad or torch.autograd.grad(loss, entropy, allow_unused=True)[0] is None
    )
    loss, _ = Algorithm(AlgorithmConfig(entropy_coef=0.1)).loss(micro_batch(entropy), 4.0, 2.0)
    (grad,) = torch.autograd.grad(loss, entropy)
    torch.testing.assert_close(grad, torch.full((2, 2), -0.1 / 4))


def test_rollout_correction_weights_scale_the_policy_loss():
    # Advantages +1 on both rows at ratio 1: token loss -1 each, weighted 2 and 0.5.
    entropy = torch.zeros(2, 2)
    plain = micro_batch(entropy, advantages=torch.ones(2, 2))
    weighted = micro_batch(
        entropy, advantages=torch.ones(2, 2), correction=torch.tensor([[2.0, 2.0], [0.5, 0.5]])
    )
    assert Algorithm(AlgorithmConfig()).loss(plain, 4.0, 2.0)[0].item() == pytest.approx(-1.0)
    assert Algorithm(AlgorithmConfig()).loss(weighted, 4.0, 2.0)[0].item() == pytest.approx(-1.25)
