"""Direct Preference Optimization (or IPO) of a causal LM on preference pairs.

    python jobs/dpo.py                                   # built-in arithmetic pairs
    python jobs/dpo.py --data.train pairs.jsonl          # your pairs (prompt, chosen, rejected)
    python jobs/dpo.py --preference.loss ipo --preference.beta 0.5 --run-dir runs/ipo1
    python jobs/dpo.py --learner.num_workers 2           # a learner group (FSDP2)

The learners are rlray's Engine with its reference model (rlray/learner/preference.py), as Ray
actors (joining ray.address or RAY_ADDRESS, else a Ray of its own), each building the
steps' pairs itself; more than one shard the models as jobs/ppo.py's do. Every
learner.eval_every steps the held-out pairs give the loss, the implicit reward margin
and its accuracy, and when the held-out prompts (data.eval) have answers, a vLLM actor
loaded with the policy's weights gives greedy exact match. Writes metrics.jsonl,
checkpoints/ (HF policy, as jobs/ppo.py's) and summary.json into the run directory.

Reads top to bottom: main (the job skeleton, rlray/driver/job.py) -> check (config,
data) -> run (learners, steps, summary).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NamedTuple

from rlray.driver.job import Job, run_job

JOB = Job(
    "dpo.py", began="training", kept="metrics.jsonl and the checkpoints so far are kept", ray=True
)
JOB.stop_while_importing()  # the imports below take seconds

from rlray.cluster.start import start_preference_learners
from rlray.config import Config, ConfigError, validate
from rlray.config.command_line import parse_command_line
from rlray.core.prompt import PromptRow
from rlray.data.models import resolve_model_path
from rlray.data.preferences import preference_batches
from rlray.data.prompts import eval_rows
from rlray.driver.plan import create_run_directory
from rlray.driver.preference import PreferenceDriver, held_out_change, run_preference_steps


def main(argv: list[str] | None = None) -> int:
    return run_job(JOB, argv, check, run)


class PreferenceRun(NamedTuple):
    """A checked preference run."""

    config: Config
    run_dir: Path
    model_path: str
    rows: list[PromptRow]
    """The held-out prompts with answers (greedy exact match), if any."""


def check(argv: list[str]) -> PreferenceRun:
    """Returns the run, its config and data checked before a model loads; creates the run
    directory. Raises ConfigError naming the bad input."""
    command = parse_command_line(argv)
    config = command.config
    validate(config)
    if command.resume_dir is not None:
        raise ConfigError("--resume: jobs/dpo.py starts from model.path only")
    # Each learner reads the data itself, from its own working directory.
    for name in ("train", "eval"):
        path = getattr(config.data, name)
        if path and not path.startswith("builtin:"):
            setattr(config.data, name, str(Path(path).resolve()))
    preference_batches(config)  # the pair file's checks; each learner reads it again
    model_path = resolve_model_path(config.model.path)
    rows = [r for r in eval_rows(config.data) if "answer" in r.columns]
    run_dir = Path(config.run_dir or f"runs/dpo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    create_run_directory(run_dir)
    return PreferenceRun(config, run_dir, model_path, rows)


def run(plan: PreferenceRun) -> int:
    """Starts the learners and the evaluation actor, trains; returns the exit code."""
    config = plan.config
    actors = start_preference_learners(config, plan.model_path, plan.run_dir.name, bool(plan.rows))
    try:
        with JOB.working():
            driver = PreferenceDriver(config, actors, plan.rows)
            summary = run_preference_steps(config, driver, plan.run_dir)
    finally:
        actors.kill()
    print(
        f"done: {summary['steps']} steps in {summary['seconds']:.0f} s; "
        f"{held_out_change(summary['initial_eval'], summary['final_eval'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
