"""The Learner in-process on the embedded tiny model: the PPO step moves probability
toward rewarded completions, and a checkpoint restores everything a run needs."""

from __future__ import annotations

import pytest
import torch

from rlray.config import Config
from rlray.episode import Episode
from rlray.learner import Learner, collate, latest_checkpoint
from rlray.models import resolve_model_path


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model_path(Config().model.path)


def make_learner(model_path: str, checkpoint: str | None = None) -> Learner:
    config = Config()
    # Adam moves every weight by about lr on its first steps; a tiny model needs a small lr.
    config.learner.lr = 1e-5
    config.learner.episodes_per_step = 4
    config.learner.minibatch_size = config.learner.micro_batch_size = 4
    return Learner(
        model_path,
        config.model,
        config.algorithm,
        config.learner,
        temperature=1.0,
        seed=0,
        checkpoint=checkpoint,
    )


def episodes_for(learner: Learner, completions: dict[str, float]) -> list[Episode]:
    """Episodes of the prompt 12+34= with the given completions and rewards, carrying the
    learner's own logprobs as rollout logprobs (as after an exact weight sync)."""
    tok = learner.tokenizer
    prompt_ids = tok("12+34=").input_ids
    ids = {text: [*tok(text).input_ids, tok.eos_token_id] for text in completions}
    episodes = [
        Episode(
            run_id="t",
            episode_id=f"t-0-{i}",
            prompt_index=0,
            sample_index=i,
            prompt="12+34=",
            completion=text,
            prompt_token_ids=prompt_ids,
            completion_token_ids=ids[text],
            rollout_logprobs=[0.0] * len(ids[text]),
            finish_reason="stop",
            policy_version=learner.version,
            rollout_worker="test",
            reward=reward,
        )
        for i, (text, reward) in enumerate(completions.items())
    ]
    for episode, logprobs in zip(episodes, learner.logprobs(episodes), strict=True):
        episode.rollout_logprobs = logprobs
    return episodes


def sequence_logprob(learner: Learner, episodes: list[Episode]) -> list[float]:
    return [sum(lp) for lp in learner.logprobs(episodes)]


def test_ppo_step_moves_probability_toward_rewarded_completions(model_path):
    learner = make_learner(model_path)
    rewards = {"46": 1.0, "57": 0.0, "35": 0.0, "68": 0.0}  # no shared first digit
    before = sequence_logprob(learner, episodes_for(learner, rewards))
    for _ in range(3):
        metrics = learner.train_step(episodes_for(learner, rewards))
        assert metrics.logprob_parity_error is not None and metrics.logprob_parity_error < 1e-5
    after = sequence_logprob(learner, episodes_for(learner, rewards))
    assert after[0] > before[0] + 0.3
    # The unrewarded ones lose probability mass together (one unlikely one may still
    # rise through what it shares with the rewarded one).
    assert torch.tensor(after[1:]).logsumexp(0) < torch.tensor(before[1:]).logsumexp(0) - 0.3
    assert learner.version == 3


def test_padding_in_a_batch_changes_no_logprob(model_path):
    learner = make_learner(model_path)
    short, long = episodes_for(learner, {"4": 0.0, "46000": 0.0})
    together = learner.logprobs([short, long])[0]
    alone = learner.logprobs([short])[0]
    torch.testing.assert_close(torch.tensor(together), torch.tensor(alone), atol=1e-5, rtol=0)
    batch = collate([short, long], learner.pad_token_id)
    assert batch.mask.sum(dim=1).tolist() == [2.0, 6.0]


def test_checkpoint_restores_weights_optimizer_version_and_cursor(model_path, tmp_path):
    learner = make_learner(model_path)
    learner.train_step(episodes_for(learner, {"46": 1.0, "45": 0.0, "47": 0.0, "56": 0.0}))
    saved = learner.save_checkpoint(tmp_path, prompt_cursor=1234)
    assert latest_checkpoint(tmp_path) == saved
    restored = make_learner(model_path, checkpoint=str(saved))
    assert restored.state() == {"version": 1, "prompt_cursor": 1234}
    for (name, a), b in zip(
        learner.policy.state_dict().items(), restored.policy.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.equal(learner.critic.head.weight, restored.critic.head.weight)
    original = learner.optimizer.state_dict()["state"]
    loaded = restored.optimizer.state_dict()["state"]
    assert original.keys() == loaded.keys()
    assert all(torch.equal(original[k]["exp_avg"], loaded[k]["exp_avg"]) for k in original)
    # The next step is the same step either way.
    episodes = {"46": 1.0, "45": 0.0, "47": 0.0, "56": 0.0}
    one = learner.train_step(episodes_for(learner, episodes))
    two = restored.train_step(episodes_for(restored, episodes))
    assert (one.policy_loss, one.value_loss) == pytest.approx(
        (two.policy_loss, two.value_loss), rel=1e-6
    )
