"""A weight sync's check (rlray.core.parity): the largest gap between the learner's and
an engine's logprobs over the policy's tokens, worked by hand."""

from __future__ import annotations

from rlray.core.episode import Episode
from rlray.core.parity import ParitySample, parity_gap


def episode(completion: list[int], mask: list[int] | None = None) -> Episode:
    return Episode(
        run_id="r",
        episode_id=f"r-{len(completion)}",
        prompt_index=0,
        sample_index=0,
        prompt="1+1=",
        completion="",
        prompt_token_ids=[1, 2],
        completion_token_ids=completion,
        rollout_logprobs=[],
        finish_reason="stop",
        policy_version=3,
        rollout_worker="rollout-0",
        completion_mask=mask or [],
    )


def test_the_gap_is_the_largest_over_the_policys_tokens():
    # Two episodes; the second's middle token is an observation (mask 0), 5 nats off.
    sample = ParitySample(
        [episode([7, 8]), episode([7, 9, 10], mask=[1, 0, 1])],
        learner_logprobs=[[-0.5, -1.0], [-2.0, -3.0, -0.25]],
        version=3,
    )
    engine = [[-0.5, -1.125], [-2.0625, -8.0, -0.25]]
    # |-1.125 - -1.0| = 0.125 and |-2.0625 - -2.0| = 0.0625; the 5.0 is not the policy's.
    assert parity_gap(sample, engine) == 0.125
    engine[1][2] = -0.75  # the second episode's last policy token, 0.5 off
    assert parity_gap(sample, engine) == 0.5


def test_a_sample_without_policy_tokens_has_no_gap():
    assert parity_gap(ParitySample([], [], version=0), []) is None
    observed = ParitySample([episode([4], mask=[0])], [[-1.0]], version=0)
    assert parity_gap(observed, [[-9.0]]) is None
