"""What one learner step reports, as plain numbers (no torch here: the driver reads it)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


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


def metrics_dict(metrics: StepMetrics) -> dict[str, Any]:
    """Returns the metrics as a JSON-ready dict (NaN becomes None)."""
    return {
        k: (None if isinstance(v, float) and math.isnan(v) else v)
        for k, v in asdict(metrics).items()
    }
