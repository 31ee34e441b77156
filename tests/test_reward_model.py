"""Reward-model training on the embedded tiny model's trunk: on a fixed set of pairs the
Bradley-Terry loss falls and pairwise accuracy rises, and the saved model loads through
the `classifier_reward` built-in, scoring in a real reward worker as it scored here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlray.config import Config, RewardSpec
from rlray.data.models import resolve_model_path
from rlray.data.preferences import preference_batches
from rlray.learner.reward_model import RewardModelTrainer, cosine_factor
from rlray.rewards.model_based import ClassifierReward, classifier_inputs
from rlray.rewards.worker import RewardWorker
from tests.jobs_helper import REPO
from tests.test_episode import make_episode


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    config = Config()
    config.preference.pairs_per_step = 32
    batches, _ = preference_batches(config)
    pairs = batches(1)
    trainer = RewardModelTrainer(resolve_model_path(config.model.path), lr=1e-3)
    before = trainer.evaluate(pairs)
    for _ in range(20):
        trainer.step(pairs)
    after = trainer.evaluate(pairs)
    directory = tmp_path_factory.mktemp("reward-model")
    trainer.save(directory)
    return trainer, pairs, before, after, directory


def test_on_a_fixed_set_the_loss_falls_and_pairs_rank_right(trained):
    _, _, before, after, _ = trained
    # A fresh score head: near chance, loss near ln 2 (measured 0.41 and 0.692).
    assert before["accuracy"] < 0.7 and abs(before["loss"] - 0.693) < 0.05
    assert after["accuracy"] == 1.0 and after["loss"] < 0.2 and after["margin"] > 1.0


def test_the_saved_model_scores_through_classifier_reward_in_a_reward_worker(trained):
    trainer, pairs, _, _, directory = trained
    spec = RewardSpec(name="classifier_reward", kwargs={"model_path": str(directory)})
    worker = RewardWorker("reward-0", [spec], "skip_component", batch_size=16)
    episodes = [
        make_episode(episode_id=f"e{i}-{kind}", prompt=pair.prompt, completion=completion)
        for i, pair in enumerate(pairs)
        for kind, completion in (("chosen", pair.chosen), ("rejected", pair.rejected))
    ]
    scored, _ = worker.score(episodes)
    rewards = torch.tensor([e.reward for e in scored])
    chosen, rejected = rewards[0::2], rewards[1::2]
    assert (chosen > rejected).all()
    # The reward worker reads (prompt, completion) as the trainer did: the same scores.
    with torch.no_grad():
        trainer.model.eval()
        want = trainer.scores([p.prompt for p in pairs], [p.chosen for p in pairs])
    torch.testing.assert_close(chosen, want, rtol=1e-4, atol=1e-4)


def test_a_pair_over_512_tokens_is_trained_on_what_the_reward_scores(trained):
    # The reward cuts (prompt, completion) to 512 tokens, the longer side first; the
    # trainer must read the same tokens, or the score it fits is read at a point the
    # reward never sees. 300 + 600 tokens: both are cut to 512 the same way.
    trainer, _, _, _, directory = trained
    prompt, completions = "12+34=" * 50, ["46" * 300, "57" * 300]
    reward = ClassifierReward(str(directory))
    with torch.no_grad():
        trainer.model.eval()
        want = trainer.scores([prompt] * 2, completions)
        trainer.model.train()
    torch.testing.assert_close(torch.tensor(reward([prompt] * 2, completions)), want)
    inputs = classifier_inputs(trainer.tokenizer, [prompt], completions[:1], 512)
    assert inputs["input_ids"].shape == (1, 512)


def test_the_learning_rate_falls_along_a_cosine_to_a_hundredth():
    assert [cosine_factor(done, 100) for done in (0, 50, 100, 150)] == pytest.approx(
        [1.0, 0.505, 0.01, 0.01]
    )
    assert cosine_factor(10**6, None) == 1.0


def test_the_trainer_steps_down_its_rate(trained):
    trainer = RewardModelTrainer(trained[0].model.name_or_path, lr=1e-3, steps=4)
    pairs = trained[1][:4]
    rates = [trainer.step(pairs)["lr"] for _ in range(4)]
    assert rates == pytest.approx([1e-3 * cosine_factor(k, 4) for k in range(4)])
    assert rates[0] == pytest.approx(1e-3) and rates[2] == pytest.approx(0.505e-3)


def run_reward_model_job(args: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "jobs/reward_model.py", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--resume", "runs/x"], "--resume"),
        (["--preference.reward_model_steps", "0"], "preference.reward_model_steps must be"),
        (["--preference.reward_model_lr", "-1"], "preference.reward_model_lr must be"),
        (["--data.train", "no-such-pairs.jsonl"], "no-such-pairs.jsonl"),
        (["--data.train", "builtin:multiplication"], "the built-in preference pairs are"),
    ],
)
def test_reward_model_job_bad_input_is_one_line_exit_2(args, message):
    result = run_reward_model_job(args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("reward_model.py: error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1
