"""The exact-match reward and the RewardWorker's weighted totals."""

import pytest

from rlray.config import ConfigError, RewardSpec
from rlray.rewards import RewardWorker, exact_match, load_rewards
from tests.test_episode import make_episode


def test_exact_match_strips_white_space_only():
    scores = exact_match(["1+1="] * 4, ["2", " 2 ", "02", "3"], answer=["2", "2", "2", "2"])
    assert scores == [1.0, 1.0, 0.0, 0.0]


def test_reward_worker_sets_total_and_components():
    worker = RewardWorker("reward-0", [RewardSpec("exact_match", weight=2.0)])
    episodes = [
        make_episode(completion="42", reward=None, reward_components={}),
        make_episode(completion="41", reward=None, reward_components={}),
    ]
    scored, stats = worker.score(episodes)
    assert [e.reward for e in scored] == [2.0, 0.0]
    assert [e.reward_components for e in scored] == [{"exact_match": 1.0}, {"exact_match": 0.0}]
    assert all(e.scored_at is not None for e in scored)
    assert stats.episodes == 2 and stats.reward_sum == 2.0


def test_unknown_reward_is_named():
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].name: unknown reward 'exact'"):
        load_rewards([RewardSpec("exact")])
