"""The small records actors return to the driver instead of episodes: what a generate
call, a scoring call, a learner step and the store did, as plain numbers (no torch here:
the driver reads them)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlray.core.episode import Episode


@dataclass
class StepMetrics:
    """What one learner step reports (a line of metrics.jsonl, with the driver's part)."""

    step: int
    policy_version: int
    episodes: int
    groups: int
    reward_mean: float
    reward_components: dict[str, float]
    """Mean of each reward component over the episodes it scored."""
    policy_loss: float
    clip_fraction: float
    entropy: float
    grad_norm: float
    advantage_abs_mean: float
    """Mean |advantage| over loss tokens: 0 means nothing was learned from this step."""
    zero_advantage_share: float
    """Share of episodes whose advantages are all 0 (e.g. groups that all got one reward)."""
    value_loss: float | None
    value_clip_fraction: float | None
    explained_variance: float | None
    kl: float | None
    """Mean KL estimate against the reference (None without one)."""
    staleness_mean: float
    logprob_parity_error: float | None
    """Max |vLLM - learner| logprob over episodes made by the learner's current weights."""
    rollout_logprob_diff_mean: float | None
    """Mean |vLLM - learner| logprob over every token with vLLM logprobs (stale too)."""
    rollout_logprob_diff_max: float | None
    rollout_ratio_outside_share: float | None
    """Share of those tokens whose ratio learner / vLLM lies outside [0.5, 2]."""
    rollout_correction_weight_mean: float
    episodes_without_logprobs: int
    """Posted episodes that came without vLLM logprobs: trained at ratio 1."""
    truncated_share: float
    learner_tokens_per_s: float
    learner_seconds: float
    completion_length_mean: float
    optimizer_updates: int = 1
    """Optimizer updates the step made: learner.epochs passes, each over its mini-batches
    (learner.minibatch_size episodes each; 0: the whole step, however many it holds)."""
    learner_tokens_computed: int = 0
    """Token positions the learner's passes of this step computed, padding included."""
    learner_padding_tokens: int = 0
    """Of those, the padding: columns of a micro-batch past a row's own tokens."""
    learner_borrowed_tokens: int = 0
    """Of those, the ones computed with idle rollout cores lent (learner.borrow_idle_cores)."""
    staleness_max: int = 0
    """The most versions behind the learner that an episode of the step was (posted
    episodes left out): never above buffer.max_staleness."""


def metrics_dict(metrics: StepMetrics) -> dict[str, Any]:
    """Returns the metrics as a JSON-ready dict (NaN becomes None)."""
    return {
        k: (None if isinstance(v, float) and math.isnan(v) else v)
        for k, v in asdict(metrics).items()
    }


@dataclass
class GenerateStats:
    """Small summary of one generate call, sent to the driver instead of the episodes."""

    worker: str
    policy_version: int
    """The oldest policy version of its episodes' tokens."""
    episodes: int
    completion_tokens: int
    """Tokens the policy generated (observation tokens of multi-turn episodes aside)."""
    seconds: float
    tool_calls: int = 0
    """Tool calls of multi-turn episodes (tool_call spans), and how many failed."""
    tool_errors: int = 0
    updated_in_flight: int = 0
    """Episodes whose tokens came from more than one policy version (a weight sync
    while they were generated: rollout.in_flight_updates)."""
    traces_dropped: int = 0
    """Agent traces that never ended within agent.trace_timeout_s (rlray.agent)."""
    first_prompt_index: int | None = None
    """With partial rollouts (RolloutWorker.generate_carrying), the lowest prompt index
    of the episodes returned: groups started by an earlier call may come back in this
    one. None otherwise."""
    returned_prompts: list[int] | None = None
    """With partial rollouts, the prompt indices of the groups returned (not this call's
    own prompts alone); None otherwise (a call returns its own prompts' groups)."""
    carried_prompts: list[int] = field(default_factory=list)
    """With partial rollouts, the prompt indices of the groups still running in the
    engine after the call (none without partial rollouts)."""


@dataclass
class EvalResult:
    """Greedy exact-match accuracy on held-out prompts at one policy version."""

    accuracy: float | None
    """None where the held-out rows have no 'answer' column to match."""
    policy_version: int
    examples: list[tuple[str, str, str]]  # (prompt, completion, answer), the first few


@dataclass
class ScoreStats:
    """Small summary of one scoring call, sent to the driver instead of the episodes."""

    worker: str
    episodes: int
    reward_sum: float
    seconds: float
    failures: dict[str, int] = field(default_factory=dict)
    """Episodes each component failed on."""
    dropped: int = 0
    """Episodes left without a reward (not trained on) under on_failure=drop_episode."""
    uniform_groups: int = 0
    """Groups split off because all their samples got the same reward (dynamic sampling)."""
    uniform_episodes: int = 0
    group_sizes: list[int] = field(default_factory=list)
    """Episodes of each group handed on for training, in order (the buffer splits a batch
    between groups where a learner step has room for part of it)."""
    group_prompts: list[int] = field(default_factory=list)
    """The prompt index of each of those groups (a checkpoint names the prompts not yet
    trained on)."""


@dataclass
class StoreStats:
    """What the store has done so far (small; goes into metrics and the summary)."""

    episodes_written: int
    files_written: int
    buffered: int
    uploads_pending: int

    @classmethod
    def total(cls, shards: list[StoreStats]) -> StoreStats:
        """Returns the stats of a store's shards, summed."""
        return cls(*(sum(getattr(shard, f.name) for shard in shards) for f in fields(cls)))


def staleness_mean(episodes: list[Episode], learner_version: int) -> float:
    """Returns how many versions behind the learner this run's episodes were, on average
    (posted episodes are left out; 0.0 if none is left)."""
    own = [learner_version - e.policy_version for e in episodes if e.prompt_index >= 0]
    return sum(own) / len(own) if own else 0.0


def staleness_max(episodes: list[Episode], learner_version: int) -> int:
    """Returns the most versions behind the learner that one of this run's episodes was
    (posted episodes are left out; 0 if none is left)."""
    return max(
        (learner_version - e.policy_version for e in episodes if e.prompt_index >= 0), default=0
    )


def component_means(episodes: list[Episode]) -> dict[str, float]:
    """Returns each reward component's mean over the episodes it has a value for."""
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for name, value in episode.reward_components.items():
            if value is not None:
                values.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in values.items()}
