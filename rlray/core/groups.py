"""Groups: the samples of one prompt, which group estimators compare with each other.

A rollout batch holds whole groups (prompts x rollout.samples_per_prompt), the buffer
hands out whole batches, so a learner step sees whole groups; the learner checks it.
With DAPO's dynamic sampling the reward workers split off groups whose samples all got
the same reward: a group estimator learns nothing from them.
"""

from __future__ import annotations

from rlray.core.episode import Episode, Span

AGENT_TRACE_COLUMN = "trace_id"
"""The column of an agent trace's episodes (rlray.agent): one sample of its prompt,
however many model calls, so however many episodes, it made."""


def group_key(episode: Episode) -> tuple[int, str]:
    """Returns what the samples of one prompt share: this run's prompt index (an agent
    trace's episodes start from different prompts: its roles'), or for posted episodes
    (prompt index -1) the prompt text."""
    return episode.prompt_index, episode.prompt if episode.prompt_index < 0 else ""


def group_indexes(episodes: list[Episode]) -> list[int]:
    """Returns each episode's group index: 0, 1, ... in order of first appearance."""
    keys: dict[tuple[int, str], int] = {}
    return [keys.setdefault(group_key(e), len(keys)) for e in episodes]


def group_sizes(episodes: list[Episode]) -> list[int]:
    """Returns the number of episodes of each group, groups in order of first appearance."""
    sizes: list[int] = []
    for index in group_indexes(episodes):
        if index == len(sizes):
            sizes.append(0)
        sizes[index] += 1
    return sizes


def group_prompts(episodes: list[Episode]) -> list[int]:
    """Returns each group's prompt index, groups in order of first appearance."""
    keys = dict.fromkeys(group_key(e) for e in episodes)
    return [prompt_index for prompt_index, _ in keys]


def select_groups(episodes: list[Episode], start: int, stop: int) -> list[Episode]:
    """Returns the episodes of groups `start` to `stop` (exclusive, in order of first
    appearance), in their order: a part of a batch the buffer split between groups."""
    return [e for e, g in zip(episodes, group_indexes(episodes), strict=True) if start <= g < stop]


def sample_indexes(episodes: list[Episode]) -> list[int]:
    """Returns each episode's sample index: 0, 1, ... in order of first appearance, the
    episodes of one agent trace sharing theirs (a trace is one sample of its prompt, so
    group statistics count it once, whatever its number of model calls)."""
    keys: dict[tuple, int] = {}
    return [
        keys.setdefault(
            (group_key(e), e.columns[AGENT_TRACE_COLUMN])
            if AGENT_TRACE_COLUMN in e.columns
            else (e.episode_id,),
            len(keys),
        )
        for e in episodes
    ]


def check_whole_groups(episodes: list[Episode], samples_per_prompt: int) -> None:
    """Raises ValueError if a prompt of this run reached the learner with some of its
    samples missing or doubled: a group split across steps biases every group estimator.
    A sample is a sample index (an agent trace's episodes are one sample); agents' groups
    may have fewer (a trace never ended is dropped), never more."""
    samples: dict[int, set[int]] = {}
    agents: set[int] = set()
    for e in episodes:
        if e.prompt_index >= 0:
            samples.setdefault(e.prompt_index, set()).add(e.sample_index)
            if AGENT_TRACE_COLUMN in e.columns:
                agents.add(e.prompt_index)
    for prompt_index, indexes in samples.items():
        count = len(indexes)
        whole = count <= samples_per_prompt if prompt_index in agents else None
        if whole is None:
            whole = count == samples_per_prompt
        if not whole:
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


def trace_spans(episodes: list[Episode]) -> list[list[Span]]:
    """Returns each episode's trace: its own spans, or for an agent trace's episodes the
    spans of the trace, which only its first episode stores (a trace's events are stored
    once, however many episodes its calls made)."""
    by_trace: dict[str, list[Span]] = {}
    for e in episodes:
        trace_id = e.columns.get(AGENT_TRACE_COLUMN)
        if trace_id is not None and e.spans:
            by_trace.setdefault(trace_id, e.spans)
    return [
        by_trace.get(e.columns[AGENT_TRACE_COLUMN], e.spans)
        if AGENT_TRACE_COLUMN in e.columns
        else e.spans
        for e in episodes
    ]
