"""The preference-learning driver (jobs/dpo.py): a learner group of PreferenceLearners,
each building its steps' pairs itself, and an evaluation actor that loads the group's
weights for greedy exact match on held-out prompts with answers.

Calls go through the training driver's recovery: the evaluation actor, restarted by Ray,
loads the group's current weights again; a learner is not restarted (the run stops,
naming it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlray.cluster.start import Actors
from rlray.config import Config
from rlray.core.prompt import PromptRow
from rlray.driver.recovery import Recovery

EVALUATOR = "eval"


class PreferenceDriver:
    """Steps, evaluations and checkpoints of a preference run."""

    def __init__(self, config: Config, actors: Actors, rows: list[PromptRow]):
        self.actors = actors
        self.rows = rows
        self.recovery = Recovery(
            actors, config.ray.call_timeout_s, config.ray.actor_start_timeout_s
        )
        self.recovery.restorers[EVALUATOR] = self._load_weights
        self.published: Any = None  # ObjectRef of the weights the evaluator holds

    def step(self, step: int) -> dict[str, Any]:
        """Runs the update of step `step` (1, 2, ...); returns its metrics."""
        return self._learners("step", step)

    def evaluate(self, step: int) -> dict[str, float]:
        """Returns the held-out pairs' metrics and, with an evaluation actor, greedy exact
        match of the policy after step `step`."""
        result = self._learners("evaluate", step)
        if self.actors.rollout:
            self.published = self.actors.learner.publish_weights.remote(step)  # rank 0's
            self._load_weights(EVALUATOR)
            evaluator = self.actors.rollout[0]
            evaluated = self.recovery.retrying(
                EVALUATOR, lambda: evaluator.evaluate.remote(self.rows), "evaluation"
            )
            result["exact_match"] = evaluated.accuracy
        return result

    def save_checkpoint(self, run_dir: Path, step: int) -> None:
        self._learners("save_checkpoint", str(run_dir), step)

    def _learners(self, method: str, *args: Any) -> Any:
        """Calls `method` on every learner; returns rank 0's answer."""
        ref = getattr(self.actors.learner, method).remote(*args)
        return self.recovery.call("learner", ref, method)

    def _load_weights(self, name: str) -> None:
        if self.published is None:  # restarted before any evaluation: nothing to load yet
            return
        evaluator = self.actors.rollout[0]
        self.recovery.retrying(
            name, lambda: evaluator.load_published.remote(self.published), "weight load"
        )
