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

Reads top to bottom: arguments -> checks -> generate and score each model -> compare.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.config import Config, ConfigError, eval_rewards, validate
from rlray.config.command_line import parse_command_line
from rlray.core.checkpoints import checkpoint_problem, latest_checkpoint
from rlray.core.evaluation import EvalSample, EvalSummary, fully_scored, summarize
from rlray.core.prompt import PromptRow
from rlray.data.models import read_prompts, resolve_model_path
from rlray.data.prompts import check_prompts_fit, eval_rows
from rlray.driver.plan import check_eval_rows
from rlray.observe.comparison import compare, comparison_markdown, write_comparison
from rlray.rewards.worker import RewardWorker
from rlray.rollout.worker import RolloutWorker

USAGE = (
    "usage: eval.py MODEL [MODEL ...] [--out DIR] [--config FILE.yaml] [--SECTION.FIELD VALUE ...]"
)


def main(argv: list[str]) -> int:
    # 1. Arguments: the models first, then --out, then config fields as jobs/ppo.py's.
    try:
        models, out, config_args = split_arguments(argv)
        config = parse_command_line(config_args).config
        validate(config)
        rows = eval_rows(config.data)
        check_eval_rows(config, rows)
        paths = {model: model_directory(model) for model in models}
        for model, path in paths.items():
            check_fits(config, rows, path, model)
    except ConfigError as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        return 2
    out = Path(out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")

    # 2. Each model in turn: greedy and sampled completions, scored by the eval rewards.
    scorer = RewardWorker(
        "reward-eval", eval_rewards(config), config.reward.on_failure, config.reward.batch_size
    )
    scored = {}
    for model, path in paths.items():
        print(f"evaluating {model} on {len(rows)} prompts", flush=True)
        scored[model] = scored_completions(config, rows, path, scorer)

    # 3. Compare on the prompts every model was scored on.
    try:
        comparison = compare(summarize_all(config, scored))
    except ValueError as err:  # e.g. rewards failed on all but one prompt
        print(f"eval.py: error: {err}", file=sys.stderr)
        return 1
    print(comparison_markdown(comparison), end="")
    json_path, markdown_path = write_comparison(comparison, out)
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


def model_directory(model: str) -> str:
    """Returns the model directory (or hub name) of a model argument: a checkpoint's
    policy, a run directory's latest checkpoint's, or model.path's resolution."""
    path = Path(model)
    if (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ConfigError(f"{model}: a run directory without a complete checkpoint")
        path = latest
    if (path / "state.json").is_file() and (path / "policy").is_dir():
        if problem := checkpoint_problem(path):
            raise ConfigError(f"{model}: checkpoint does not verify: {problem}")
        return str((path / "policy").resolve())
    try:
        return resolve_model_path(model)
    except ConfigError as err:
        raise ConfigError(f"{model}: {str(err).removeprefix('model.path: ')}") from None


def check_fits(config: Config, rows: list[PromptRow], path: str, model: str) -> None:
    """Raises ConfigError (naming the model) unless every held-out prompt fits with its
    completion in the context window, read by this model's tokenizer."""
    (read,) = read_prompts(path, [[r.prompt for r in rows]])
    try:
        check_prompts_fit(
            rows,
            [tokens.count for tokens in read],
            config.completion_budget,
            config.model.max_model_len,
            "data.eval",
        )
    except ConfigError as err:
        raise ConfigError(f"{model}: {err}") from None


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


def summarize_all(config: Config, scored: dict[str, list[EvalSample]]) -> list[EvalSummary]:
    """Returns each model's summary on the prompts whose completions were scored for
    every model (a prompt a reward failed on for one model is left out for all)."""
    left_out = set()
    for samples in scored.values():
        left_out.update(fully_scored(samples)[1])
    if left_out:
        print(f"left out {len(left_out)} prompts: a reward failed on one of their completions")
    settings = config.eval
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
