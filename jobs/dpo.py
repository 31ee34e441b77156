"""Direct Preference Optimization (or IPO) of a causal LM on preference pairs.

    python jobs/dpo.py                                   # built-in arithmetic pairs
    python jobs/dpo.py --data.train pairs.jsonl          # your pairs (prompt, chosen, rejected)
    python jobs/dpo.py --preference.loss ipo --preference.beta 0.5 --run-dir runs/ipo1
    python jobs/dpo.py --learner.num_workers 2           # a learner group (FSDP2), on Ray

The learner is rlray's Engine with its reference model (rlray/dpo.py); every
learner.eval_every steps the held-out pairs give the loss, the implicit reward margin and
its accuracy, and when the held-out prompts (data.eval) have answers, a vLLM engine
loaded with the policy's weights gives greedy exact match. One learner runs in this
process; `learner.num_workers` > 1 runs a group of learner actors on Ray (joining
ray.address or RAY_ADDRESS, else a Ray of its own), its models sharded across them as
in jobs/ppo.py, each building the steps' pairs itself. Writes metrics.jsonl,
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

from rlray.config import Config, ConfigError, parse_command_line, validate
from rlray.data import eval_rows
from rlray.models import resolve_model_path
from rlray.preferences import preference_batches


def main(argv: list[str]) -> int:
    # 1. Config and data: every check before a model loads.
    try:
        command = parse_command_line(argv)
        config = command.config
        validate(config)
        if command.resume_dir is not None:
            raise ConfigError("--resume: jobs/dpo.py starts from model.path only")
        preference_batches(config)  # the pair file's checks; each learner reads it again
        model_path = resolve_model_path(config.model.path)
    except ConfigError as err:
        print(f"dpo.py: error: {err}", file=sys.stderr)
        return 2
    run_dir = Path(config.run_dir or f"runs/dpo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"run directory: {run_dir}", flush=True)

    # 2. Learners: one in this process, or a group of learner actors.
    from rlray.actors import ActorFailure

    learners = Learners(config)
    try:
        learners.start(model_path, run_dir.name)
        summary = train(config, learners, run_dir)
    except ActorFailure as err:
        print(f"dpo.py: error: {err}", file=sys.stderr)
        return 1
    finally:
        learners.close()
    print(
        f"done: {summary['steps']} steps in {summary['seconds']:.0f} s; "
        f"{describe_change(summary['initial_eval'], summary['final_eval'])}"
    )
    return 0


def train(config: Config, learners: Learners, run_dir: Path) -> dict[str, Any]:
    """Runs the steps (evaluations and checkpoints on schedule); returns the summary."""
    # 3. Loop: one update per batch of pairs.
    steps, started = config.learner.steps, time.perf_counter()
    evaluations = {0: learners.evaluate(0)}
    print(describe(0, evaluations[0]), flush=True)
    for step in range(1, steps + 1):
        record = learners.step(step)
        last = step == steps
        if step % config.learner.eval_every == 0 or last:
            evaluations[step] = record["eval"] = learners.evaluate(step)
            print(describe(step, evaluations[step]), flush=True)
        if step % config.learner.checkpoint_every == 0 or last:
            learners.save_checkpoint(run_dir, step)
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


class Learners:
    """The run's PreferenceLearners, called as one: the single learner in this process,
    or every actor of the group (rank 0's result, within ray.call_timeout_s), whose
    weights an evaluation actor (`eval`, vLLM) loads for greedy exact match."""

    def __init__(self, config: Config):
        self.config = config
        self.timeout_s = config.ray.call_timeout_s
        self.local = self.group = self.evaluator = self.placement = None
        self.rows = [r for r in eval_rows(config.data) if "answer" in r.columns]

    def start(self, model_path: str, run_id: str) -> None:
        config = self.config
        if config.learner.num_workers == 1:
            from rlray.dpo import PreferenceLearner

            device = "cuda" if config.learner.gpus > 0 else "cpu"
            self.local = PreferenceLearner(config, model_path, run_id, device)
            return
        from rlray.actors import connect, required_cpus, start_preference_learners

        connect(config.ray.address, max(config.ray.num_cpus, int(required_cpus(config) + 0.999)))
        self.group, self.evaluator, self.placement = start_preference_learners(
            config, model_path, run_id, evaluator=bool(self.rows)
        )

    def step(self, step: int) -> dict[str, Any]:
        return self._call("step", step)

    def evaluate(self, step: int) -> dict[str, float]:
        result = self._call("evaluate", step)
        if self.evaluator is not None:
            from rlray.actors import wait_for

            published = self.group.publish_weights.remote(step)  # rank 0's ref
            loaded = self.evaluator.load_published.remote(published)
            wait_for(loaded, "eval", "weight load", self.timeout_s)
            evaluated = self.evaluator.evaluate.remote(self.rows)
            result["exact_match"] = wait_for(
                evaluated, "eval", "evaluation", self.timeout_s
            ).accuracy
        return result

    def save_checkpoint(self, run_dir: Path, step: int) -> None:
        self._call("save_checkpoint", str(run_dir), step)

    def _call(self, method: str, *args: Any) -> Any:
        if self.local is not None:
            return getattr(self.local, method)(*args)
        from rlray.actors import wait_for

        ref = getattr(self.group, method).remote(*args)
        return wait_for(ref, "learner", method, self.timeout_s)

    def close(self) -> None:
        """Shuts the local learner's vLLM engine down; a group's actors (and the
        evaluation actor's engine) end with this process, their placement now."""
        if self.local is not None:
            self.local.close()
        if self.placement is not None:
            self.placement.release()


def describe(step: int, evaluation: dict) -> str:
    shown = ["exact_match", "pairs/accuracy", "pairs/reward_margin", "pairs/loss"]
    values = "  ".join(f"{k} {evaluation[k]:.3f}" for k in shown if k in evaluation)
    return f"eval  step {step:4d}  {values}"


def describe_change(first: dict, last: dict) -> str:
    keys = [k for k in ("exact_match", "pairs/accuracy") if k in first]
    return ", ".join(f"held-out {k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
