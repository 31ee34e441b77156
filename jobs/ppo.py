"""RL fine-tuning of a causal LM (REINFORCE++, the GRPO family, PPO with a critic): vLLM
rollout actors, reward actors, a buffer, a learner.

    python jobs/ppo.py                      # embedded tiny model + arithmetic task
    python jobs/ppo.py --help               # every config field with its doc
    python jobs/ppo.py --algorithm.advantage rloo --learner.lr 1e-5 --run-dir runs/exp1
    python jobs/ppo.py --resume runs/exp1   # continue from the last checkpoint
    ray job submit --working-dir . -- python jobs/ppo.py   # the same on a cluster

Reads top to bottom: main -> start (config, checks) -> run (actors) -> train (steps)
-> report.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any


def _interrupted_while_importing(signum: int, frame: object) -> None:
    # Nothing has started yet that would need stopping: out at once, in one line.
    sys.stderr.write("ppo.py: interrupted before training began\n")
    os._exit(130)


# Until main() takes over (Ray, torch and vLLM take seconds to import).
for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, _interrupted_while_importing)

# `python jobs/ppo.py` puts jobs/ on sys.path, not the repository; a cluster job's
# working directory is the repository, so this finds rlray without an install too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.cluster.calls import ActorFailure
from rlray.cluster.connection import connect, required_cpus
from rlray.cluster.start import start_actors, start_agent, start_ingest
from rlray.config import ConfigError, validate
from rlray.config.command_line import parse_command_line
from rlray.core.interrupts import stop_at_once_on_signals, stop_on_sigterm
from rlray.driver.plan import RunPlan, plan_run, write_config
from rlray.driver.run_log import HeldStep, RunLog, RunSummary
from rlray.driver.training import TrainingDriver
from rlray.observe.timing import describe_totals


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here
    stop_on_sigterm()  # `ray job stop` (SIGTERM) stops a run as Ctrl-C does
    try:
        return start(argv)
    except KeyboardInterrupt:
        print("ppo.py: interrupted before training began", file=sys.stderr)
        return 130


def start(argv: list[str]) -> int:
    """Checks the config, joins Ray and runs, resuming after a lost actor."""
    # Config: defaults < --config file < command line; every check before any actor.
    try:
        command = parse_command_line(argv)
        validate(command.config)
        if command.config.agent.enabled and not command.config.agent.train:
            raise ConfigError(
                "agent.train: false is collect-only; run jobs/collect.py --agent.enabled true"
            )
        plan = plan_run(command.config, command.resume_dir)
        write_config(plan)
    except ConfigError as err:
        print(f"ppo.py: error: {err}", file=sys.stderr)
        return 2
    config = plan.config
    connect(config.ray.address, max(config.ray.num_cpus, int(required_cpus(config) + 0.999)))
    print(f"run directory: {plan.run_dir}", flush=True)
    # If an actor is lost for good (the learner, or a node), the run resumes by itself.
    for restart in range(config.ray.max_job_restarts + 1):
        try:
            return run(plan)
        except RunLost as lost:
            if restart == config.ray.max_job_restarts:
                print(
                    f"ppo.py: error: {lost} (gave up after {restart} restarts: "
                    "ray.max_job_restarts)",
                    file=sys.stderr,
                )
                return 1
            plan = plan.resumed()
            start = plan.checkpoint.name if plan.checkpoint else "the start"
            print(f"ppo.py: {lost}; resuming from {start}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


class RunLost(Exception):
    """An actor died and Ray did not bring it back: the run resumes from its checkpoint."""


def run(plan: RunPlan) -> int:
    """Starts the actors, trains, reports; returns the exit code."""
    config = plan.config
    checkpoint = plan.checkpoint and str(plan.checkpoint)
    try:
        actors = start_actors(config, plan.model_path, plan.run_id, checkpoint)
        if config.ingest.enabled:
            timeout_s = config.ray.actor_start_timeout_s
            url = start_ingest(config, actors, plan.model_path, str(plan.run_dir), timeout_s)
            print(f"ingestion endpoint: {url}", flush=True)
        if config.agent.enabled:
            url = start_agent(config, actors, plan.model_path, plan.run_id)
            print(f"agent endpoint: {url}", flush=True)
    except ActorFailure as err:
        print(f"ppo.py: error: {err}", file=sys.stderr)
        return 1
    driver = TrainingDriver(plan, actors, *plan.resume_point())
    log = RunLog(plan, actors, driver.clock)
    summary = None
    try:
        summary = train(plan, driver, log)
    except ActorFailure as err:
        if err.died:
            raise RunLost(str(err)) from err
        print(f"ppo.py: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "ppo.py: interrupted; every episode so far is kept, --resume continues from "
            "the last checkpoint",
            file=sys.stderr,
        )
        return 130
    finally:
        # Agents hear the run is done, and the traces they left open are dropped: the
        # batches in flight come back at once, with every trace whose reward was accepted.
        actors.close_agent(config.ray.call_timeout_s)
        stored = driver.close_store()  # every scored episode written (or spooled)
        log.close()
        actors.kill()
        if summary is None:
            log.trackers.close()
    summary.episodes_stored = stored.episodes_written if stored else None
    report(plan, summary, log)
    return 0


def train(plan: RunPlan, driver: TrainingDriver, log: RunLog) -> RunSummary:
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


def report(plan: RunPlan, summary: RunSummary, log: RunLog) -> None:
    """Writes summary.json and report.png, closes the trackers, prints the outcome."""
    (plan.run_dir / "summary.json").write_text(summary.to_json())
    log.trackers.summary(summary.__dict__)
    log.trackers.close()
    # matplotlib (27 MiB) loads once the actors are gone, out of the run's memory peak
    from rlray.observe.report import write_report

    picture = write_report(plan.run_dir)
    print(
        f"done: {summary.steps} steps, {summary.held_out_change()}, "
        f"{summary.episodes_per_second:.1f} episodes/s, {summary.wall_seconds:.0f} s, "
        f"{summary.optimizer_updates} optimizer updates"
    )
    if best := summary.best_eval:
        where = best["checkpoint"] or f"the base model, {best['model']}"
        print(f"best: {best['metric']} {best['value']:.3f} at step {best['step']} ({where})")
    print(f"time: {describe_totals(summary.phase_seconds)}")
    if summary.memory_peak_gib is not None:
        largest = list(summary.memory_peak_by_process_gib.items())[:6]
        shares = ", ".join(f"{name} {size:.2f}" for name, size in largest)
        print(f"memory: peak {summary.memory_peak_gib:.2f} GiB (PSS: {shares}, ...)")
    print(f"report: {picture}")
    print(f"run directory: {plan.run_dir}")


if __name__ == "__main__":
    code = main(sys.argv[1:])
    stop_at_once_on_signals()  # Ray shuts down at exit: a signal then ends it at once
    sys.exit(code)
