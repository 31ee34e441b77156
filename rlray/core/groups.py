"""Groups: the samples of one prompt, which group estimators compare with each other.

A rollout batch holds whole groups (prompts x rollout.samples_per_prompt), the buffer
hands out whole batches, so a learner step sees whole groups; the learner checks it.
With DAPO's dynamic sampling the reward workers split off groups whose samples all got
the same reward: a group estimator learns nothing from them.
"""

from __future__ import annotations

from rlray.core.episode import Episode


def group_key(episode: Episode) -> tuple[int, str]:
    """Returns what the samples of one prompt share: this run's prompt index, or for
    posted episodes (prompt index -1) the prompt text."""
    return episode.prompt_index, episode.prompt


def group_indexes(episodes: list[Episode]) -> list[int]:
    """Returns each episode's group index: 0, 1, ... in order of first appearance."""
    keys: dict[tuple[int, str], int] = {}
    return [keys.setdefault(group_key(e), len(keys)) for e in episodes]


def check_whole_groups(episodes: list[Episode], samples_per_prompt: int) -> None:
    """Raises ValueError if a prompt of this run reached the learner with some of its
    samples missing or doubled: a group split across steps biases every group estimator."""
    counts: dict[int, int] = {}
    for e in episodes:
        if e.prompt_index >= 0:
            counts[e.prompt_index] = counts.get(e.prompt_index, 0) + 1
    for prompt_index, count in counts.items():
        if count != samples_per_prompt:
            raise ValueError(
                f"prompt {prompt_index} reached the learner with {count} of its "
                f"{samples_per_prompt} samples: a group was split across steps"
            )


def split_uniform_groups(episodes: list[Episode]) -> tuple[list[Episode], list[Episode]]:
    """Returns (episodes of groups whose rewards differ, episodes of uniform groups), each
    in the original order. A group is uniform when its scored samples all got the same
    reward (a group of one included); episodes without a reward do not count."""
    rewards: dict[tuple[int, str], set[float]] = {}
    for e in episodes:
        scores = rewards.setdefault(group_key(e), set())
        if e.reward is not None:
            scores.add(e.reward)
    mixed = {key for key, scores in rewards.items() if len(scores) > 1}
    kept = [e for e in episodes if group_key(e) in mixed]
    uniform = [e for e in episodes if group_key(e) not in mixed]
    return kept, uniform
