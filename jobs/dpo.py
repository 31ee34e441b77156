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

Reads top to bottom: config -> data -> learners -> loop -> summary.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.cluster.calls import ActorFailure
from rlray.cluster.connection import connect, required_cpus
from rlray.cluster.start import start_preference_learners
from rlray.config import Config, ConfigError, validate
from rlray.config.command_line import parse_command_line
from rlray.data.models import resolve_model_path
from rlray.data.preferences import preference_batches
from rlray.data.prompts import eval_rows
from rlray.driver.plan import create_run_directory
from rlray.driver.preference import PreferenceDriver


def main(argv: list[str]) -> int:
    # 1. Config and data: every check before a model loads.
    try:
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
        run_dir = Path(config.run_dir or f"runs/dpo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        create_run_directory(run_dir)
    except ConfigError as err:
        print(f"dpo.py: error: {err}", file=sys.stderr)
        return 2
    print(f"run directory: {run_dir}", flush=True)

    # 2. Learners and the evaluation actor, on Ray.
    rows = [r for r in eval_rows(config.data) if "answer" in r.columns]
    connect(config.ray.address, max(config.ray.num_cpus, int(required_cpus(config) + 0.999)))
    try:
        actors = start_preference_learners(config, model_path, run_dir.name, bool(rows))
    except ActorFailure as err:
        print(f"dpo.py: error: {err}", file=sys.stderr)
        return 1
    try:
        summary = train(config, PreferenceDriver(config, actors, rows), run_dir)
    except ActorFailure as err:
        print(f"dpo.py: error: {err}", file=sys.stderr)
        return 1
    finally:
        actors.kill()
    print(
        f"done: {summary['steps']} steps in {summary['seconds']:.0f} s; "
        f"{describe_change(summary['initial_eval'], summary['final_eval'])}"
    )
    return 0


def train(config: Config, driver: PreferenceDriver, run_dir: Path) -> dict[str, Any]:
    """Runs the steps (evaluations and checkpoints on schedule); returns the summary."""
    # 3. Loop: one update per batch of pairs.
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

    # 4. Summary: held-out figures before and after.
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
    shown = ["exact_match", "pairs/accuracy", "pairs/reward_margin", "pairs/loss"]
    values = "  ".join(f"{k} {evaluation[k]:.3f}" for k in shown if k in evaluation)
    return f"eval  step {step:4d}  {values}"


def describe_change(first: dict, last: dict) -> str:
    keys = [k for k in ("exact_match", "pairs/accuracy") if k in first]
    return ", ".join(f"held-out {k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
