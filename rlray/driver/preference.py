"""The preference-learning driver (jobs/dpo.py): a learner group of PreferenceLearners,
each building its steps' pairs itself, and an evaluation actor that loads the group's
weights for greedy exact match on held-out prompts with answers; the run's steps
(`run_preference_steps`), evaluations and checkpoints on their schedules; and the
reward model's steps (`run_reward_model_steps`, jobs/reward_model.py: one process).

Calls go through the training driver's recovery: the evaluation actor, restarted by Ray,
loads the group's current weights again; a learner is not restarted (the run stops,
naming it)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlray.cluster.start import Actors
from rlray.config import Config
from rlray.core.prompt import PromptRow
from rlray.data.preferences import PreferencePair
from rlray.driver.recovery import Recovery

if TYPE_CHECKING:
    from rlray.learner.reward_model import RewardModelTrainer

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


def run_preference_steps(config: Config, driver: PreferenceDriver, run_dir: Path) -> dict[str, Any]:
    """Runs the steps, one update per batch of pairs (evaluations and checkpoints on
    schedule); writes metrics.jsonl and summary.json; returns the summary."""
    steps, started = config.learner.steps, time.perf_counter()
    evaluations = {0: driver.evaluate(0)}
    print(describe(0, evaluations[0]), flush=True)
    for step in range(1, steps + 1):
        record = driver.step(step)
        last = step == steps
        if step % config.learner.eval_every == 0 or last:
            evaluations[step] = record["eval"] = driver.evaluate(step)
            print(describe(step, evaluations[step]), flush=True)
        if step % config.learner.checkpoint_every == 0 or last:
            driver.save_checkpoint(run_dir, step)
        with (run_dir / "metrics.jsonl").open("a") as metrics:
            metrics.write(json.dumps(record) + "\n")
    # Held-out figures before and after.
    summary = {
        "steps": steps,
        "pairs_per_step": config.preference.pairs_per_step,
        "learners": config.learner.num_workers,
        "seconds": time.perf_counter() - started,
        "initial_eval": evaluations[0],
        "final_eval": evaluations[steps],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def describe(step: int, evaluation: dict) -> str:
    """Returns a DPO evaluation's console line."""
    shown = ["exact_match", "pairs/accuracy", "pairs/reward_margin", "pairs/loss"]
    values = "  ".join(f"{k} {evaluation[k]:.3f}" for k in shown if k in evaluation)
    return f"eval  step {step:4d}  {values}"


def held_out_change(first: dict, last: dict) -> str:
    """Returns how held-out exact match and pair accuracy went from one evaluation to
    another."""
    keys = [k for k in ("exact_match", "pairs/accuracy") if k in first]
    return ", ".join(f"held-out {k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys)


def run_reward_model_steps(
    config: Config,
    trainer: RewardModelTrainer,
    batches: Callable[[int], list[PreferencePair]],
    held_out: list[PreferencePair],
    run_dir: Path,
) -> dict[str, Any]:
    """Fits a reward model in preference.reward_model_steps steps, one update per batch
    of pairs, the held-out pairs evaluated on schedule; writes metrics.jsonl, the model
    (run_dir/reward_model) and summary.json; returns the summary."""
    steps, started = config.preference.reward_model_steps, time.perf_counter()
    evaluations = {0: trainer.evaluate(held_out)}
    print(describe_reward_model(0, evaluations[0]), flush=True)
    for step in range(1, steps + 1):
        record = {"step": step, **trainer.step(batches(step))}
        if step % config.learner.eval_every == 0 or step == steps:
            evaluations[step] = record["eval"] = trainer.evaluate(held_out)
            print(describe_reward_model(step, evaluations[step]), flush=True)
        with (run_dir / "metrics.jsonl").open("a") as metrics:
            metrics.write(json.dumps(record) + "\n")
    trainer.save(run_dir / "reward_model")
    # Held-out figures before and after, and where the model is.
    summary = {
        "steps": steps,
        "pairs_per_step": config.preference.pairs_per_step,
        "held_out_pairs": len(held_out),
        "seconds": time.perf_counter() - started,
        "initial_eval": evaluations[0],
        "final_eval": evaluations[steps],
        "reward_model": str(run_dir / "reward_model"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def describe_reward_model(step: int, evaluation: dict[str, float]) -> str:
    """Returns a reward model's evaluation's console line."""
    values = "  ".join(f"{key} {evaluation[key]:.3f}" for key in ("accuracy", "margin", "loss"))
    return f"eval  step {step:5d}  {values}"
