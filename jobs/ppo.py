"""RL fine-tuning of a causal LM (REINFORCE++, the GRPO family, PPO with a critic): vLLM
rollout actors, reward actors, a buffer, a learner.

    python jobs/ppo.py                      # embedded tiny model + arithmetic task
    python jobs/ppo.py --help               # every config field with its doc
    python jobs/ppo.py --algorithm.advantage rloo --learner.lr 1e-5 --run-dir runs/exp1
    python jobs/ppo.py --resume runs/exp1   # continue from the last checkpoint
    ray job submit --working-dir . -- python jobs/ppo.py   # the same on a cluster

Reads top to bottom: main (the job skeleton, rlray/driver/job.py) -> check (config)
-> run (actors, steps, report).
"""

from __future__ import annotations

import sys

from rlray.driver.job import Job, run_job

JOB = Job(
    "ppo.py",
    began="training",
    kept="every episode so far is kept, --resume continues from the last checkpoint",
    ray=True,
    restarts=True,  # after the learner (or a node) is lost for good
)
JOB.stop_while_importing()  # the imports below take seconds

from rlray.cluster.start import start_actors, start_agent, start_ingest
from rlray.config import ConfigError, validate
from rlray.config.command_line import parse_command_line
from rlray.driver.plan import RunPlan, plan_run, write_config
from rlray.driver.run_log import RunLog
from rlray.driver.steps import run_steps
from rlray.driver.training import TrainingDriver


def main(argv: list[str] | None = None) -> int:
    return run_job(JOB, argv, check, run)


def check(argv: list[str]) -> RunPlan:
    """Returns the run's plan (config: defaults < --config file < command line), every
    check done; writes config.yaml. Raises ConfigError naming the bad input."""
    command = parse_command_line(argv)
    validate(command.config)
    if command.config.agent.enabled and not command.config.agent.train:
        raise ConfigError(
            "agent.train: false is collect-only; run jobs/collect.py --agent.enabled true"
        )
    plan = plan_run(command.config, command.resume_dir)
    write_config(plan)
    return plan


def run(plan: RunPlan) -> int:
    """Starts the actors, trains, reports; returns the exit code."""
    config = plan.config
    checkpoint = plan.checkpoint and str(plan.checkpoint)
    actors = start_actors(config, plan.model_path, plan.run_id, checkpoint)
    if config.ingest.enabled:
        timeout_s = config.ray.actor_start_timeout_s
        url = start_ingest(config, actors, plan.model_path, str(plan.run_dir), timeout_s)
        print(f"ingestion endpoint: {url}", flush=True)
    if config.agent.enabled:
        url = start_agent(config, actors, plan.model_path, plan.run_id)
        print(f"agent endpoint: {url}", flush=True)
    driver = TrainingDriver(plan, actors, *plan.resume_point())
    log = RunLog(plan, actors, driver.clock)
    summary = None
    try:
        with JOB.working():
            summary = run_steps(plan, driver, log)
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
    log.report(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
