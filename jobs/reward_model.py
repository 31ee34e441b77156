"""Reward-model training: a one-output sequence-classification head on a causal LM's
trunk, fit to preference pairs with the Bradley-Terry loss (rlray/learner/reward_model.py).

    python jobs/reward_model.py                                # built-in arithmetic pairs
    python jobs/reward_model.py --data.train pairs.jsonl --run-dir runs/rm1

The trunk is model.path (the embedded model by default). At step 0, every
learner.eval_every steps and at the end, the held-out pairs (preference.eval_pairs) give
the Bradley-Terry loss, the pairwise accuracy (chosen scored above rejected) and the
mean score margin. The model is written in HF format to <run dir>/reward_model, where
the `classifier_reward` built-in loads it, so an RL run trains against it:

    python jobs/ppo.py --reward.functions \\
        '[{name: classifier_reward, kwargs: {model_path: runs/rm1/reward_model}}]'

Also writes metrics.jsonl and summary.json. One process, no Ray.

Reads top to bottom: main (the job skeleton, rlray/driver/job.py) -> check (config,
data) -> train (model, loop, summary).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from rlray.driver.job import Job, run_job

JOB = Job(
    "reward_model.py",
    began="training",
    kept="metrics.jsonl holds the steps so far; no reward model was saved",
)
JOB.stop_while_importing()  # the imports below take seconds

from rlray.config import Config, ConfigError, validate
from rlray.config.command_line import parse_command_line
from rlray.config.schema import MICRO_BATCH_ROWS
from rlray.data.models import resolve_model_path
from rlray.data.preferences import PreferencePair, preference_batches
from rlray.driver.plan import create_run_directory
from rlray.driver.preference import run_reward_model_steps


def main(argv: list[str] | None = None) -> int:
    return run_job(JOB, argv, check, train)


class RewardModelRun(NamedTuple):
    """A checked reward-model run."""

    config: Config
    run_dir: Path
    model_path: str
    batches: Callable[[int], list[PreferencePair]]
    """Returns step N's batch of pairs."""
    held_out: list[PreferencePair]


def check(argv: list[str]) -> RewardModelRun:
    """Returns the run, its config and data checked before the model loads; creates the
    run directory. Raises ConfigError naming the bad input."""
    command = parse_command_line(argv)
    config = command.config
    validate(config)
    if command.resume_dir is not None:
        raise ConfigError("--resume: jobs/reward_model.py starts from model.path only")
    batches, held_out = preference_batches(config)
    model_path = resolve_model_path(config.model.path)
    run_dir = Path(config.run_dir or f"runs/rm-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    create_run_directory(run_dir)
    return RewardModelRun(config, run_dir, model_path, batches, held_out)


def train(run: RewardModelRun) -> int:
    """Fits the reward model to the pairs, writes it and the summary; returns the exit
    code."""
    print(f"run directory: {run.run_dir}", flush=True)
    # torch loads only once the input is checked: a bad one is told at once.
    from rlray.learner.reward_model import RewardModelTrainer

    config, preference, learner = run.config, run.config.preference, run.config.learner
    trainer = RewardModelTrainer(  # the trunk with a fresh one-output score head
        run.model_path,
        lr=preference.reward_model_lr,
        steps=preference.reward_model_steps,
        center_coef=preference.reward_model_center,
        max_grad_norm=learner.max_grad_norm,
        micro_batch_size=learner.micro_batch_size or MICRO_BATCH_ROWS,  # no token bound here
        seed=config.seed,
    )
    with JOB.working():
        summary = run_reward_model_steps(config, trainer, run.batches, run.held_out, run.run_dir)
    first, last = summary["initial_eval"], summary["final_eval"]
    print(
        f"done: {summary['steps']} steps in {summary['seconds']:.0f} s; held-out pairwise "
        f"accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f}; "
        f"reward model: {summary['reward_model']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
