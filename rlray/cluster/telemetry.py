"""Ray metrics of a run, for the Ray dashboard, Prometheus and grafana/rlray-dashboard.json.

Every metric is defined here, once, with its tags; actors record through `Telemetry`,
which tags each value with the run id (and the worker, where the metric has that tag).
Ray exports them with the prefix `ray_` from each node's metrics export port, counters
with the suffix `_total` (e.g. `ray_rlray_episodes_generated_total`).
"""

from __future__ import annotations

from typing import Any

from ray.util import metrics

STALENESS_BOUNDARIES = [0.5, 1.5, 2.5, 4.5, 8.5]
RUN = ("run_id",)
RUN_WORKER = ("run_id", "worker")

# name: (kind, description, tag keys)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "rlray_rollout_tokens_per_second": (
        "gauge",
        "Completion tokens/s of a rollout worker's last batch",
        RUN_WORKER,
    ),
    "rlray_episodes_generated": ("counter", "Episodes generated", RUN_WORKER),
    "rlray_episodes_scored": ("counter", "Episodes scored", RUN_WORKER),
    "rlray_uniform_groups_dropped": (
        "counter",
        "Groups left out because all their samples got the same reward"
        " (with algorithm.drop_uniform_groups)",
        RUN_WORKER,
    ),
    "rlray_buffer_depth": ("gauge", "Episodes held by the buffer", RUN),
    # A gauge holding the running total, not a counter: Ray exports a counter only once
    # incremented, and a run that drops nothing should show 0, not no data.
    "rlray_dropped_stale": ("gauge", "Episodes dropped as stale so far", RUN),
    "rlray_staleness": ("histogram", "Versions behind the learner, per trained episode", RUN),
    "rlray_reward_mean": ("gauge", "Mean reward of the last learner step", RUN),
    "rlray_eval_accuracy": ("gauge", "Held-out greedy accuracy of the last evaluation", RUN),
    "rlray_learner_step_seconds": ("gauge", "Seconds of the last learner step", RUN),
    "rlray_weight_sync_seconds": ("gauge", "Seconds of the last weight sync", RUN),
    "rlray_policy_version": ("gauge", "Policy version a worker holds", RUN_WORKER),
    "rlray_logprob_parity_error": (
        "gauge",
        "Largest |vLLM - learner| logprob of fresh episodes at the last step",
        RUN,
    ),
    "rlray_rollout_logprob_diff_mean": (
        "gauge",
        "Mean |vLLM - learner| logprob of the last step's tokens (mismatch plus staleness)",
        RUN,
    ),
}

_created: dict[str, Any] = {}


def _metric(name: str) -> Any:
    """Returns the process's one instance of a metric (Ray wants each created once)."""
    if name not in _created:
        kind, description, tags = METRICS[name]
        if kind == "gauge":
            _created[name] = metrics.Gauge(name, description, tag_keys=tags)
        elif kind == "counter":
            _created[name] = metrics.Counter(name, description, tag_keys=tags)
        else:
            _created[name] = metrics.Histogram(
                name, description, boundaries=STALENESS_BOUNDARIES, tag_keys=tags
            )
    return _created[name]


class Telemetry:
    """Records a run's metrics from one process (an actor or the driver)."""

    def __init__(self, run_id: str, worker: str = ""):
        self.run_id = run_id
        self.worker = worker

    def _tags(self, name: str) -> dict[str, str]:
        keys = METRICS[name][2]
        return (
            {"run_id": self.run_id, "worker": self.worker}
            if "worker" in keys
            else {"run_id": self.run_id}
        )

    def set(self, name: str, value: float | None) -> None:
        """Sets a gauge (None: nothing to report)."""
        if value is not None:
            _metric(name).set(float(value), tags=self._tags(name))

    def add(self, name: str, count: float) -> None:
        """Adds to a counter."""
        if count > 0:
            _metric(name).inc(float(count), tags=self._tags(name))

    def observe(self, name: str, value: float, times: int = 1) -> None:
        """Records a histogram value `times` times."""
        histogram, tags = _metric(name), self._tags(name)
        for _ in range(times):
            histogram.observe(float(value), tags=tags)
