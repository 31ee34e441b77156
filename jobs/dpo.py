"""Direct Preference Optimization (or IPO) of a causal LM on preference pairs.

    python jobs/dpo.py                                   # built-in arithmetic pairs
    python jobs/dpo.py --data.train pairs.jsonl          # your pairs (prompt, chosen, rejected)
    python jobs/dpo.py --preference.loss ipo --preference.beta 0.5 --run-dir runs/ipo1

The learner is rlray's Engine with its reference model (rlray/dpo.py); every
learner.eval_every steps the held-out pairs give the loss, the implicit reward margin and
its accuracy, and when the held-out prompts (data.eval) have answers, a vLLM engine
loaded with the policy's weights gives greedy exact-match accuracy. One learner, in
this process. Writes metrics.jsonl, checkpoints/ (HF policy, as jobs/ppo.py's) and
summary.json into the run directory.

Reads top to bottom: config -> data -> models -> loop -> summary.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.checkpoints import publish_checkpoint, staging_directory
from rlray.config import Config, ConfigError, parse_command_line, validate
from rlray.data import PromptRow, eval_rows
from rlray.models import resolve_model_path
from rlray.preferences import PreferencePair, preference_batches


def main(argv: list[str]) -> int:
    # 1. Config and data: every check before a model loads.
    try:
        command = parse_command_line(argv)
        config = command.config
        validate(config)
        if command.resume_dir is not None:
            raise ConfigError("--resume: jobs/dpo.py starts from model.path only")
        if config.learner.num_workers > 1:
            raise ConfigError("learner.num_workers: jobs/dpo.py trains in one learner")
        batches, held_out = preference_batches(config)
        rows = [r for r in eval_rows(config.data) if "answer" in r.columns]
        model_path = resolve_model_path(config.model.path)
    except ConfigError as err:
        print(f"dpo.py: error: {err}", file=sys.stderr)
        return 2
    run_dir = Path(config.run_dir or f"runs/dpo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"run directory: {run_dir}", flush=True)

    # 2. Models: the policy and its reference; vLLM for greedy exact match.
    trainer, tokenizer = make_trainer(config, model_path)
    evaluator = ExactMatch(config, model_path, run_dir.name, rows) if rows else None

    # 3. Loop: one update per batch of pairs; evaluations and checkpoints on schedule.
    steps, started, log = config.learner.steps, time.perf_counter(), []
    evaluations = {0: evaluate(trainer, held_out, evaluator, 0)}
    print(describe(0, evaluations[0]), flush=True)
    for step in range(1, steps + 1):
        record = {"step": step, **trainer.step(batches(step))}
        last = step == steps
        if step % config.learner.eval_every == 0 or last:
            evaluations[step] = evaluate(trainer, held_out, evaluator, step)
            record["eval"] = evaluations[step]
            print(describe(step, evaluations[step]), flush=True)
        if step % config.learner.checkpoint_every == 0 or last:
            save_checkpoint(trainer, tokenizer, run_dir, step, model_path)
        log.append(record)
        with (run_dir / "metrics.jsonl").open("a") as metrics:
            metrics.write(json.dumps(record) + "\n")

    # 4. Summary: held-out figures before and after.
    summary = {
        "steps": steps,
        "pairs_per_step": config.preference.pairs_per_step,
        "seconds": time.perf_counter() - started,
        "initial_eval": evaluations[0],
        "final_eval": evaluations[steps],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"done: {steps} steps in {summary['seconds']:.0f} s; {describe_change(evaluations)}")
    if evaluator is not None:
        evaluator.close()
    return 0


def make_trainer(config: Config, model_path: str):
    """Returns the DPO trainer (engine with its reference model) and the tokenizer."""
    from transformers import AutoTokenizer

    from rlray.dpo import DpoTrainer
    from rlray.engine import Engine

    learner, preference = config.learner, config.preference
    engine = Engine(
        model_path,
        dtype=config.model.dtype,
        lr=learner.lr,
        max_grad_norm=learner.max_grad_norm,
        micro_batch_size=learner.micro_batch_size,
        with_reference=True,
        gradient_checkpointing=learner.gradient_checkpointing,
        seed=config.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = DpoTrainer(
        engine, tokenizer, preference.loss, preference.beta, preference.label_smoothing
    )
    return trainer, tokenizer


class ExactMatch:
    """Greedy exact-match accuracy of the policy on held-out prompts, by a vLLM engine
    in this process that loads the policy's weights before each evaluation."""

    def __init__(self, config: Config, model_path: str, run_id: str, rows: list[PromptRow]):
        from rlray.rollout import RolloutWorker

        self.rows = rows
        self.dtype = config.model.dtype
        self.worker = RolloutWorker("eval", model_path, config.model, config.rollout, run_id, 0)

    def accuracy(self, trainer, version: int) -> float:
        import torch

        from rlray.weights import publishable_weights, tied_output_name, weights_for_vllm

        policy = trainer.engine.policy
        weights = publishable_weights(policy, getattr(torch, self.dtype))
        architecture = self.worker.llm.model_config.architecture
        self.worker.load_weights(
            version, weights_for_vllm(weights, tied_output_name(policy), architecture)
        )
        return self.worker.evaluate(self.rows).accuracy

    def close(self) -> None:
        self.worker.close()


def evaluate(trainer, held_out: list[PreferencePair], evaluator, step: int) -> dict:
    """Returns the held-out pairs' metrics (and exact-match accuracy) at this step."""
    result = {f"pairs/{key}": value for key, value in trainer.evaluate(held_out).items()}
    if evaluator is not None:
        result["exact_match"] = evaluator.accuracy(trainer, step)
    return result


def save_checkpoint(trainer, tokenizer, run_dir: Path, step: int, model_path: str) -> None:
    staging = staging_directory(run_dir, step)
    trainer.engine.save(staging, tokenizer)
    publish_checkpoint(staging, {"version": step, "step": step, "reference_model": model_path})


def describe(step: int, evaluation: dict) -> str:
    shown = ["exact_match", "pairs/accuracy", "pairs/reward_margin", "pairs/loss"]
    values = "  ".join(f"{k} {evaluation[k]:.3f}" for k in shown if k in evaluation)
    return f"eval  step {step:4d}  {values}"


def describe_change(evaluations: dict[int, dict]) -> str:
    first, last = evaluations[0], evaluations[max(evaluations)]
    keys = [k for k in ("exact_match", "pairs/accuracy") if k in first]
    return ", ".join(f"held-out {k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
