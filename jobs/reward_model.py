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

Reads top to bottom: config -> data -> model -> loop -> summary.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.config import ConfigError, validate
from rlray.config.command_line import parse_command_line
from rlray.config.schema import MICRO_BATCH_ROWS
from rlray.data.models import resolve_model_path
from rlray.data.preferences import preference_batches
from rlray.driver.plan import create_run_directory


def main(argv: list[str]) -> int:
    # 1. Config and data: every check before the model loads.
    try:
        command = parse_command_line(argv)
        config = command.config
        validate(config)
        if command.resume_dir is not None:
            raise ConfigError("--resume: jobs/reward_model.py starts from model.path only")
        batches, held_out = preference_batches(config)
        model_path = resolve_model_path(config.model.path)
        run_dir = Path(config.run_dir or f"runs/rm-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        create_run_directory(run_dir)
    except ConfigError as err:
        print(f"reward_model.py: error: {err}", file=sys.stderr)
        return 2
    print(f"run directory: {run_dir}", flush=True)

    # 2. Model: the trunk with a fresh one-output score head.
    from rlray.learner.reward_model import RewardModelTrainer

    preference, learner = config.preference, config.learner
    steps = preference.reward_model_steps
    trainer = RewardModelTrainer(
        model_path,
        lr=preference.reward_model_lr,
        steps=steps,
        center_coef=preference.reward_model_center,
        max_grad_norm=learner.max_grad_norm,
        micro_batch_size=learner.micro_batch_size or MICRO_BATCH_ROWS,  # no token bound here
        seed=config.seed,
    )

    # 3. Loop: one update per batch of pairs; held-out pairs on schedule.
    started = time.perf_counter()
    evaluations = {0: trainer.evaluate(held_out)}
    print(describe(0, evaluations[0]), flush=True)
    for step in range(1, steps + 1):
        record = {"step": step, **trainer.step(batches(step))}
        if step % learner.eval_every == 0 or step == steps:
            evaluations[step] = record["eval"] = trainer.evaluate(held_out)
            print(describe(step, evaluations[step]), flush=True)
        with (run_dir / "metrics.jsonl").open("a") as metrics:
            metrics.write(json.dumps(record) + "\n")
    trainer.save(run_dir / "reward_model")

    # 4. Summary: held-out figures before and after, and where the model is.
    first, last = evaluations[0], evaluations[steps]
    summary = {
        "steps": steps,
        "pairs_per_step": preference.pairs_per_step,
        "held_out_pairs": len(held_out),
        "seconds": time.perf_counter() - started,
        "initial_eval": first,
        "final_eval": last,
        "reward_model": str(run_dir / "reward_model"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"done: {steps} steps in {summary['seconds']:.0f} s; held-out pairwise accuracy "
        f"{first['accuracy']:.3f} -> {last['accuracy']:.3f}; "
        f"reward model: {summary['reward_model']}"
    )
    return 0


def describe(step: int, evaluation: dict[str, float]) -> str:
    values = "  ".join(f"{key} {evaluation[key]:.3f}" for key in ("accuracy", "margin", "loss"))
    return f"eval  step {step:5d}  {values}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
