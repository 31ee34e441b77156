"""Groups of samples of one prompt: indexed in order, refused when split, and uniform
groups split off for dynamic sampling with every episode accounted for."""

import pytest

from rlray.config import RewardSpec
from rlray.core.episode import Episode
from rlray.core.groups import (
    AGENT_TRACE_COLUMN,
    check_whole_groups,
    group_indexes,
    sample_indexes,
    split_uniform_groups,
)
from rlray.rewards.worker import RewardWorker


def episode(prompt_index: int, sample: int, reward: float | None, prompt: str = "") -> Episode:
    return Episode(
        run_id="r",
        episode_id=f"r-{prompt_index}-{sample}",
        prompt_index=prompt_index,
        sample_index=sample,
        prompt=prompt or f"{prompt_index}+1=",
        completion=str(prompt_index + 1) if reward else "0",
        prompt_token_ids=[1],
        completion_token_ids=[2],
        rollout_logprobs=[-0.1],
        finish_reason="stop",
        policy_version=0,
        rollout_worker="rollout-0",
        columns={"answer": str(prompt_index + 1)},
        reward=reward,
    )


def test_group_indexes_follow_first_appearance_and_posted_prompts_group_by_text():
    episodes = [episode(5, 0, 1), episode(3, 0, 1), episode(5, 1, 0)]
    episodes += [episode(-1, 0, 1, "2+2="), episode(-1, 0, 0, "2+2="), episode(-1, 0, 1, "3+3=")]
    assert group_indexes(episodes) == [0, 1, 0, 2, 2, 3]


def test_an_agent_traces_episodes_are_one_sample_and_every_other_episode_its_own():
    calls = [episode(7, 1, 0.0) for _ in range(3)]  # one trace's three model calls
    for index, call in enumerate(calls):
        call.episode_id += f"-t-{index}"
        call.columns[AGENT_TRACE_COLUMN] = "t"
    other = episode(7, 2, 0.0)
    other.columns[AGENT_TRACE_COLUMN] = "u"
    posted = [episode(-1, 0, 1, "2+2="), episode(-1, 0, 1, "2+2=")]
    posted[1].episode_id = "r-posted-2"
    episodes = [episode(7, 0, 1.0), *calls, other, *posted]
    assert sample_indexes(episodes) == [0, 1, 1, 1, 2, 3, 4]


def test_split_groups_are_refused_and_posted_episodes_are_not_checked():
    whole = [episode(0, s, 1.0) for s in range(4)] + [episode(-1, 0, 1.0, "x")]
    check_whole_groups(whole, samples_per_prompt=4)
    with pytest.raises(ValueError, match="prompt 0 reached the learner with 5 of its 4"):
        check_whole_groups([*whole, episode(0, 4, 1.0)], samples_per_prompt=4)


def test_an_agent_trace_is_one_sample_however_many_episodes_and_may_be_missing():
    def call(prompt_index: int, sample: int, prompt: str) -> Episode:
        made = episode(prompt_index, sample, 1.0, prompt)
        made.columns["trace_id"] = f"t{prompt_index}-{sample}"
        return made

    # prompt 0: sample 0's trace made a solver and a checker call (two prompts); sample
    # 1's and 2's one call each; sample 3's trace was dropped (never ended)
    traces = [call(0, 0, "solve"), call(0, 0, "check"), call(0, 1, "solve"), call(0, 2, "s")]
    assert group_indexes(traces) == [0, 0, 0, 0]  # one group, whatever each call's prompt
    check_whole_groups(traces, samples_per_prompt=4)
    with pytest.raises(ValueError, match="with 5 of its 4"):
        check_whole_groups([*traces, call(0, 3, "s"), call(0, 4, "s")], samples_per_prompt=4)


def test_uniform_groups_are_split_off_whole():
    mixed = [episode(0, 0, 1.0), episode(0, 1, 0.0), episode(0, 2, None)]
    all_right = [episode(1, 0, 1.0), episode(1, 1, 1.0), episode(1, 2, None)]
    all_wrong = [episode(2, s, 0.0) for s in range(3)]
    kept, uniform = split_uniform_groups([*all_right, *mixed, *all_wrong])
    assert kept == mixed  # the unscored episode stays with its group
    assert uniform == [*all_right, *all_wrong]


def test_reward_worker_splits_uniform_groups_after_scoring():
    worker = RewardWorker("reward-0", [RewardSpec(name="exact_match")])
    right, wrong = "2", "0"
    batch = [episode(1, 0, None), episode(1, 1, None), episode(2, 0, None), episode(2, 1, None)]
    batch[0].completion, batch[1].completion = right, wrong  # prompt 1: 1+1=, mixed
    batch[2].completion = batch[3].completion = wrong  # prompt 2: both wrong
    kept, uniform, stats = worker.score_and_split(batch)
    assert [e.episode_id for e in kept] == ["r-1-0", "r-1-1"]
    assert [e.episode_id for e in uniform] == ["r-2-0", "r-2-1"]
    assert (stats.uniform_groups, stats.uniform_episodes, stats.episodes) == (1, 2, 4)
    assert [e.reward for e in kept] == [1.0, 0.0]


def test_reward_worker_keeps_a_reward_an_agent_posted_and_scores_the_rest():
    worker = RewardWorker("reward-0", [RewardSpec(name="exact_match")])
    posted, unscored, rescored = episode(1, 0, 0.25), episode(1, 1, None), episode(1, 2, 0.7)
    posted.columns["trace_id"] = unscored.columns["trace_id"] = "t"  # agents' episodes
    posted.completion = unscored.completion = rescored.completion = "2"  # 1+1=: right
    scored, _ = worker.score([posted, unscored, rescored])
    assert [e.reward for e in scored] == [0.25, 1.0, 1.0]
