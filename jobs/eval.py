"""Evaluates models or checkpoints on held-out prompts with a reward config and compares
them with the first: base vs trained, each metric, the difference and its standard error.

    python jobs/eval.py builtin:tiny-arithmetic runs/exp1     # base vs the run's latest
    python jobs/eval.py BASE runs/exp1/checkpoints/step-000050 runs/exp1/checkpoints/step-000150 \\
        --config runs/exp1/config.yaml --eval.samples 8 --eval.pass_k '[1, 8]' --out eval-exp1
    ray job submit --entrypoint-num-gpus 1 --working-dir . -- python jobs/eval.py ...

A model is a model directory or hub name (as model.path), a checkpoint directory, or a
run directory (its latest checkpoint). Every other flag is a jobs/ppo.py config field:
data.eval and data.eval_size choose the prompts, reward.functions (or eval.rewards)
score them, eval.* sets samples, pass@k and the pass threshold, rollout.* how completions
are generated. A run's config.yaml (--config) evaluates the way that run did.

Every model answers the same prompts with the same sampling seeds, so the comparison is
paired (rlray.evaluation.compare). Prints the table and writes comparison.json and
comparison.md to --out (default runs/eval-<time>).

Reads top to bottom: main (the job skeleton, rlray/driver/job.py) -> check (arguments,
models, prompts) -> evaluate (generate and score each model, compare).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NamedTuple

from rlray.driver.job import Job, run_job

JOB = Job("eval.py", began="evaluation", kept="nothing is written")
JOB.stop_while_importing()  # the imports below take seconds

from rlray.config import Config, ConfigError, eval_rewards, validate
from rlray.config.command_line import parse_command_line
from rlray.core.evaluation import EvalSample
from rlray.core.prompt import PromptRow
from rlray.data.prompts import eval_rows
from rlray.driver.evaluation import summarize_all
from rlray.driver.plan import check_eval_rows, check_model_fits, model_directory
from rlray.observe.comparison import compare, comparison_markdown, write_comparison
from rlray.rewards.worker import RewardWorker
from rlray.rollout.worker import RolloutWorker

USAGE = (
    "usage: eval.py MODEL [MODEL ...] [--out DIR] [--config FILE.yaml] [--SECTION.FIELD VALUE ...]"
)


def main(argv: list[str] | None = None) -> int:
    return run_job(JOB, argv, check, evaluate)


class EvalRun(NamedTuple):
    """A checked evaluation: the config, the held-out prompts, each model's directory."""

    config: Config
    rows: list[PromptRow]
    paths: dict[str, str]
    out: Path


def check(argv: list[str]) -> EvalRun:
    """Returns the evaluation: the models first, then --out, then config fields as
    jobs/ppo.py's, every model and prompt checked. Raises ConfigError naming the bad
    input."""
    models, out, config_args = split_arguments(argv)
    config = parse_command_line(config_args).config
    validate(config)
    rows = eval_rows(config.data)
    check_eval_rows(config, rows)
    paths = {model: model_directory(model) for model in models}
    for model, path in paths.items():
        check_model_fits(config, rows, path, model)
    return EvalRun(config, rows, paths, Path(out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}"))


def evaluate(run: EvalRun) -> int:
    """Generates each model's greedy and sampled completions, scores them with the eval
    rewards and compares the models; returns the exit code."""
    config, rows = run.config, run.rows
    scorer = RewardWorker(
        "reward-eval", eval_rewards(config), config.reward.on_failure, config.reward.batch_size
    )
    scored = {}
    with JOB.working():
        for model, path in run.paths.items():
            print(f"evaluating {model} on {len(rows)} prompts", flush=True)
            scored[model] = scored_completions(config, rows, path, scorer)
    # Compared on the prompts every model was scored on.
    try:
        comparison = compare(summarize_all(config.eval, scored))
    except ValueError as err:  # e.g. rewards failed on all but one prompt
        JOB.say(f"error: {err}")
        return 1
    print(comparison_markdown(comparison), end="")
    json_path, markdown_path = write_comparison(comparison, run.out)
    print(f"written: {json_path} {markdown_path}")
    return 0


def split_arguments(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """Returns (models, --out or None, the config arguments). Models come first, before
    any flag; raises ConfigError if there is none or one is named twice."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(f"usage: {USAGE}\n\n{__doc__}")
        sys.exit(0)
    first_flag = next((i for i, arg in enumerate(argv) if arg.startswith("-")), len(argv))
    models, rest = argv[:first_flag], argv[first_flag:]
    if not models:
        raise ConfigError(f"name at least one model to evaluate ({USAGE})")
    for model in models:
        if models.count(model) > 1:
            raise ConfigError(f"model {model!r} is named twice")
    out = None
    for i, arg in enumerate(rest):
        if arg == "--out" and i + 1 < len(rest):
            out, rest = rest[i + 1], rest[:i] + rest[i + 2 :]
            break
        if arg.startswith("--out="):
            out, rest = arg.removeprefix("--out="), rest[:i] + rest[i + 1 :]
            break
    return models, out, rest


def scored_completions(
    config: Config, rows: list[PromptRow], path: str, scorer: RewardWorker
) -> list[EvalSample]:
    """Returns every held-out completion of one model with its scores; its engine is
    shut down before the next model's starts."""
    worker = RolloutWorker("eval", path, config.model, config.rollout, "eval", config.seed)
    try:
        episodes, _ = worker.eval_episodes(rows, config.eval.samples, config.eval.temperature)
    finally:
        worker.close()
    # Scheduled reward weights as at the end of training, the same for every model.
    return scorer.evaluate(episodes, step=config.learner.steps)


if __name__ == "__main__":
    sys.exit(main())
