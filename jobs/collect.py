"""Collect episodes without training: rollout and reward actors with a fixed model over a
prompt set, every scored episode written to the episode store.

    python jobs/collect.py --prompts 512                       # built-in task, tiny model
    python jobs/collect.py --model path/to/model --data.train prompts.jsonl   # one pass
    python jobs/collect.py --prompts 1000 --store.path s3://bucket/datasets/run1
    python jobs/collect.py --held-out --agent.enabled true --model.path runs/x/checkpoints/...

Takes the same config fields as jobs/ppo.py (the ppo, learner and buffer ones are
ignored), and recovers from a dead rollout, reward or store actor as jobs/ppo.py does.
For datasets, baselines and evaluation. `--held-out` collects the held-out prompts
(data.eval, or the built-in task's held-out set) once each. With `--agent.enabled true`
the episodes are agents' traces (docs/agents.md): the endpoint serves the model to them,
and the store keeps what it served (the collect-only mode of agent.train false).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace

from rlray.driver.job import Job, run_job

JOB = Job("collect.py", began="collecting", kept="every episode so far is kept", ray=True)
JOB.stop_while_importing()  # the imports below take seconds

from rlray.cluster.start import start_actors, start_agent
from rlray.config import ConfigError, validate
from rlray.config.command_line import parse_command_line
from rlray.data.prompts import FilePrompts
from rlray.driver.collecting import CollectDriver
from rlray.driver.plan import RunPlan, plan_run, write_config


def main(argv: list[str] | None = None) -> int:
    return run_job(JOB, argv, check, collect)


@dataclass
class Collection(RunPlan):
    """A collect run's plan, with how many prompts it collects."""

    prompt_count: int = 0


def check(argv: list[str]) -> Collection:
    """Returns the collect run's plan, every check done; writes config.yaml. Raises
    ConfigError naming the bad input."""
    prompt_count, held_out, rest = parse_prompt_count(argv)
    command = parse_command_line(rest)
    validate(command.config)
    plan = plan_run(command.config, resume_dir=None)
    if held_out:
        plan = replace(plan, prompts=FilePrompts(plan.eval_rows, seed=0, shuffle=False))
    collection = Collection(**vars(plan), prompt_count=prompt_count or one_pass(plan))
    write_config(plan)
    return collection


def collect(run: Collection) -> int:
    """Starts rollout, reward and store actors (no buffer, no learner), generates, scores
    and stores every prompt's samples; returns the exit code."""
    config = run.config
    actors = start_actors(config, run.model_path, run.run_id, train=False)
    if config.agent.enabled:
        url = start_agent(config, actors, run.model_path, run.run_id)
        print(f"agent endpoint: {url}", flush=True)
    driver = CollectDriver(run, actors)
    try:
        with JOB.working():
            summary = driver.collect(run.prompt_count)
    finally:
        # Agents hear the run is done; traces they left open are dropped (see ppo.py).
        actors.close_agent(config.ray.call_timeout_s)
        stored = driver.close_store()  # every scored episode written (or spooled)
        actors.kill()
    summary.episodes_stored = stored.episodes_written if stored else None
    (run.run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    print(
        f"done: {summary.episodes} episodes of {run.prompt_count} prompts, reward mean "
        f"{summary.reward_mean:.3f}, {summary.episodes_per_second:.1f} episodes/s"
    )
    print(f"episodes: {summary.store}")
    return 0


def parse_prompt_count(argv: list[str]) -> tuple[int | None, bool, list[str]]:
    """Returns (--prompts N or None, --held-out, the other arguments)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--held-out", action="store_true")
    known, rest = parser.parse_known_args(argv)
    if known.prompts is not None and known.prompts <= 0:
        raise ConfigError(f"--prompts must be > 0, got {known.prompts}")
    if "--help" in rest or "-h" in rest:
        print("collect.py --prompts N: how many prompts (default: one pass over data.train)")
        print("collect.py --held-out: the held-out prompts instead, once each")
    return known.prompts, known.held_out, rest


def one_pass(plan: RunPlan) -> int:
    """Returns the prompt count of one pass over a prompt file."""
    if isinstance(plan.prompts, FilePrompts):
        return len(plan.prompts.rows)
    raise ConfigError("--prompts: the built-in task has no end; say how many prompts to collect")


if __name__ == "__main__":
    sys.exit(main())
