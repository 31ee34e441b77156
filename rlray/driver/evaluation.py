"""Held-out evaluations: rollout-0 generates, the first scorer (the store's process, or
reward-0) scores, and only the scores come back to the driver, which summarises them into
metrics and keeps the best checkpoint by one of them. Also the models' summaries that
jobs/eval.py compares (`summarize_all`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlray.cluster.calls import ActorFailure
from rlray.cluster.start import Actors
from rlray.config import EvalConfig
from rlray.core.checkpoints import BEST
from rlray.core.evaluation import (
    EvalSample,
    EvalSummary,
    components_failed_everywhere,
    fully_scored,
    summarize,
    without_components,
)
from rlray.core.prompt import PromptRow
from rlray.core.stats import EvalResult
from rlray.driver.recovery import Recovery
from rlray.observe.timing import PhaseClock

logger = logging.getLogger(__name__)


@dataclass
class Evaluation:
    """One held-out evaluation: exact match and the metrics of the eval rewards."""

    result: EvalResult
    """Greedy exact-match accuracy (None without answers), version, examples."""
    summary: EvalSummary
    """Every metric (rlray.evaluation.summarize) with its standard error."""
    prompts_left_out: int
    """Held-out prompts left out because a reward failed on one of their completions."""
    rewards_failed: list[str] = field(default_factory=list)
    """Reward components that failed on every held-out completion: left out of the metrics."""

    def record(self) -> dict[str, Any]:
        """Returns the evaluation's fields of a metrics.jsonl line."""
        metrics = self.summary.metrics
        return {
            "eval_accuracy": self.result.accuracy,
            "eval_policy_version": self.result.policy_version,
            "eval": {name: m.value for name, m in metrics.items()},
            "eval_stderr": {name: m.stderr for name, m in metrics.items()},
            "eval_prompts_left_out": self.prompts_left_out,
            "eval_rewards_failed": self.rewards_failed,
        }


def summarize_evaluation(
    model: str, result: EvalResult, samples: list[EvalSample], settings: EvalConfig
) -> Evaluation:
    """Returns the evaluation of `model` from its exact-match result and its scored
    held-out completions. A reward that failed on every completion is left out of the
    metrics, and prompts another reward failed on are left out (each logged); with fewer
    than 2 prompts left, the evaluation has exact match only. A failing reward costs its
    own scores, never the run."""
    failed = components_failed_everywhere(samples)
    if failed:
        logger.warning(
            "warning: evaluation of %s: reward %s failed on every held-out completion; "
            "its metrics are left out (the reward worker's log has its first error)",
            model,
            ", ".join(failed),
        )
    kept, left_out = fully_scored(without_components(samples, failed))
    prompts = len({s.prompt_id for s in samples})
    if left_out:
        logger.warning(
            "warning: evaluation of %s: %d of %d held-out prompts left out: a reward failed "
            "on one of their completions",
            model,
            len(left_out),
            prompts,
        )
    ks = settings.pass_k if settings.samples else []
    if prompts - len(left_out) >= 2:
        summary = summarize(model, kept, ks, settings.pass_threshold)
    else:
        logger.warning(
            "warning: evaluation of %s: fewer than 2 held-out prompts have every score; "
            "it has no reward metrics",
            model,
        )
        summary = EvalSummary(model, (), 0, settings.pass_threshold, {})
    return Evaluation(result, summary, len(left_out), failed)


class Evaluator:
    """Evaluates the policy that rollout-0 holds on the run's held-out prompts."""

    def __init__(
        self,
        actors: Actors,
        rows: list[PromptRow],
        settings: EvalConfig,
        recovery: Recovery,
        clock: PhaseClock,
    ):
        self.actors = actors
        self.rows = rows
        self.settings = settings
        self.recovery = recovery
        self.clock = clock

    def evaluate(self, version: int) -> Evaluation:
        """Returns the held-out evaluation of policy `version`: greedy and eval.samples
        sampled completions per prompt, scored by the eval rewards."""
        rollout, reward = self.actors.rollout[0], self.actors.reward[0]
        made: dict[str, Any] = {}

        def generate() -> Any:
            made["episodes"], result = self._generate(rollout)
            return result

        with self.clock.phase("evaluation"):
            result = self.recovery.retrying(self.actors.rollout_names[0], generate, "evaluate")
            samples = self.recovery.retrying(
                self.actors.reward_names[0],
                lambda: reward.evaluate.remote(made["episodes"], version),
                "score evaluation",
            )
        return summarize_evaluation(f"step {version}", result, samples, self.settings)

    def start(self, version: int) -> PendingEvaluation:
        """Starts the held-out evaluation of policy `version` (generation, then scoring,
        chained in the object store) and returns at once; `finish` waits for it."""
        episodes, result = self._generate(self.actors.rollout[0])
        samples = self.actors.reward[0].evaluate.remote(episodes, version)
        return PendingEvaluation(version, result, samples)

    def finish(self, pending: PendingEvaluation) -> Evaluation:
        """Returns a started evaluation's result. If rollout-0 or its scorer died under
        it, the evaluation runs again, on the policy rollout-0 then holds (its
        eval_policy_version says which)."""
        calls = [
            (self.actors.rollout_names[0], pending.result, "evaluate"),
            (self.actors.reward_names[0], pending.samples, "score evaluation"),
        ]
        got = []
        with self.clock.phase("evaluation"):
            for name, ref, what in calls:
                try:
                    got.append(self.recovery.call(name, ref, what))
                except ActorFailure as err:
                    if not err.died:
                        raise
                    self.recovery.recover(name, err)
                    break
            else:
                return summarize_evaluation(f"step {pending.version}", *got, self.settings)
        logger.warning("evaluation of step %d: evaluating again", pending.version)
        return self.evaluate(pending.version)

    def _generate(self, rollout: Any) -> tuple[Any, Any]:
        """Starts rollout-0's held-out generation: (episodes, result) ObjectRefs."""
        settings = self.settings
        return rollout.eval_episodes.options(num_returns=2).remote(
            self.rows, settings.samples, settings.temperature
        )


@dataclass
class PendingEvaluation:
    """A held-out evaluation under way (Evaluator.start): its ObjectRefs."""

    version: int
    """The learner version the evaluation was started at."""
    result: Any
    """rollout-0's EvalResult."""
    samples: Any
    """The scorer's scored samples."""


class BestCheckpoint:
    """The run's best evaluation by one metric, in checkpoints/best.json: its step, the
    metric's value and standard error, and the checkpoint of that step (None for step 0,
    the base model, whose path `model` names).

    Higher is better (every metric is a reward's); of equal values the first is kept. A
    resumed run continues the record of the steps it kept."""

    def __init__(self, run_dir: str | Path, metric: str, before_step: int):
        self.metric = metric
        self.path = Path(run_dir) / "checkpoints" / BEST
        self.best: dict[str, Any] | None = None
        if metric and self.path.is_file():
            kept = json.loads(self.path.read_text())
            if kept.get("metric") == metric and kept["step"] < before_step:
                self.best = kept

    def improves(self, metrics: dict[str, Any]) -> bool:
        """Returns True if an evaluation's metrics (name: value) beat the best so far; an
        evaluation without the metric (its reward failed) does not."""
        if not self.metric or self.metric not in metrics:
            return False
        return self.best is None or metrics[self.metric] > self.best["value"]

    def record(
        self, step: int, value: float, stderr: float, checkpoint: str | None, model: str
    ) -> None:
        """Makes this evaluation the best and writes best.json (atomically)."""
        self.best = {
            "metric": self.metric,
            "step": step,
            "value": value,
            "stderr": stderr,
            "checkpoint": checkpoint,
            "model": model,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".tmp")
        staging.write_text(json.dumps(self.best, indent=2))
        staging.rename(self.path)


def summarize_all(settings: EvalConfig, scored: dict[str, list[EvalSample]]) -> list[EvalSummary]:
    """Returns each model's summary on the prompts whose completions were scored for
    every model (a prompt a reward failed on for one model is left out for all), for
    jobs/eval.py's paired comparison."""
    left_out = set()
    for samples in scored.values():
        left_out.update(fully_scored(samples)[1])
    if left_out:
        print(f"left out {len(left_out)} prompts: a reward failed on one of their completions")
    ks = settings.pass_k if settings.samples else []
    return [
        summarize(
            model,
            [s for s in samples if s.prompt_id not in left_out],
            ks,
            settings.pass_threshold,
        )
        for model, samples in scored.items()
    ]
