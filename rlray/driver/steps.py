"""A training run's steps: each trains, syncs weights, evaluates and checkpoints on its
schedule (the last step all three), and is logged.

An evaluation may run beside the next step's training (eval.beside_training): its step
is then held, its line written once the evaluation is back. Its policy may prove the
best after the learner has moved on, so its checkpoint is saved at once but staged,
and published only if the evaluation is the best (else discarded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlray.driver.plan import RunPlan
from rlray.driver.run_log import RunLog, RunSummary
from rlray.driver.training import TrainingDriver


@dataclass
class HeldStep:
    """A step whose evaluation runs beside the next step's training: its record, timed,
    is written once the evaluation is back."""

    step: int
    record: dict[str, Any]
    version: int
    staged: bool
    """Its checkpoint is staged: kept if the evaluation is the best, else discarded."""


def run_steps(plan: RunPlan, driver: TrainingDriver, log: RunLog) -> RunSummary:
    """Runs learner steps up to learner.steps: each syncs weights, evaluates and saves a
    checkpoint on its schedule (and the last step all three); returns the summary."""
    learner = plan.config.learner
    log.start()
    # Rollout workers start from the base model: give them the learner's weights (the
    # checkpoint's, in a resumed run) before anything is generated.
    driver.sync_weights()
    held = None  # a step whose evaluation runs beside the next step's training
    if driver.learner_version == 0:
        first = {"step": 0, "policy_version": 0}
        last = log.first_step > learner.steps
        held = close_step(driver, log, 0, first, evaluate=True, checkpoint=False, last=last)
    for step in range(log.first_step, learner.steps + 1):
        record = driver.train_step()
        if held is not None:
            release(driver, log, held)
        last = step == learner.steps
        evaluate = step % learner.eval_every == 0 or last
        checkpoint = step % learner.checkpoint_every == 0 or last
        if step % learner.sync_every == 0 or last:
            # A step that closes without asking the learner for a checkpoint may let the
            # next one start training while the workers load its weights.
            record.update(driver.sync_weights(start_next=not (evaluate or checkpoint)))
        held = close_step(driver, log, step, record, evaluate, checkpoint, last)
    return log.summary()


def close_step(
    driver: TrainingDriver,
    log: RunLog,
    step: int,
    record: dict[str, Any],
    evaluate: bool,
    checkpoint: bool,
    last: bool,
) -> HeldStep | None:
    """Evaluates, checkpoints and logs a step; returns it held instead when its
    evaluation runs beside the next step's training (eval.beside_training)."""
    if evaluate and not last and driver.evaluates_beside_training:
        # Its policy may prove the best after the learner has moved on: checkpointed now,
        # staged until the evaluation says.
        staged = not checkpoint and step > 0 and bool(log.best.metric)
        if checkpoint or staged:
            record["checkpoint"] = str(driver.save_checkpoint(publish=not staged))
        driver.evaluate_beside_next_step()
        log.timed(step, record)
        return HeldStep(step, record, driver.learner_version, staged)
    evaluation = driver.evaluate() if evaluate else None
    # The best evaluation's policy is kept: checkpointed now if it would not be (step
    # 0's is the base model's).
    if checkpoint or (step > 0 and log.is_best(evaluation)):
        record["checkpoint"] = str(driver.save_checkpoint())
    log.step(step, record, evaluation)
    return None


def release(driver: TrainingDriver, log: RunLog, held: HeldStep) -> None:
    """Writes a held step's line with its evaluation, keeping its staged checkpoint if
    that evaluation is the best."""
    evaluation = driver.finish_evaluation()
    if held.staged:
        kept = driver.publish_staged(held.version, keep=log.is_best(evaluation))
        if kept is None:
            del held.record["checkpoint"]
        else:
            held.record["checkpoint"] = str(kept)
    log.write(held.step, held.record, evaluation)
