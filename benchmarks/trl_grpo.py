"""TRL's GRPOTrainer on a task spec written by benchmarks/vs_trl.py; runs in TRL's own
virtualenv (it imports nothing from rlray, which is not installed there).

    <trl venv>/bin/python benchmarks/trl_grpo.py SPEC.json RESULT.json

The spec names the model directory, the training rows in order (a prompt, text or chat
messages, and the columns its reward reads), the held-out rows, the reward (exact match,
or a reasoning-gym task's own scorer) and the shape of a step (episodes, group size,
mini-batches, epochs). One "step" here is what it is in rlray: one generation batch of
`episodes_per_step` episodes and the `epochs * episodes_per_step / minibatch_size`
optimizer updates made on it. The clock counts training only: held-out evaluations are
timed and subtracted. Time spent generating and scoring is kept apart from the rest.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def text(completion) -> str:
    """A completion's text, whether TRL passes it as text or as chat messages."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_match(prompts: list, completions: list, answer: list, **_: object) -> list[float]:
    """The reward rlray's default job uses: 1.0 where the stripped completion equals the
    answer."""
    return [
        float(text(c).strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)
    ]


def reasoning_gym_score(
    prompts: list, completions: list, answer: list, metadata: list, task: list, task_config: list,
    question: list, **_: object,
) -> list[float]:  # fmt: skip
    """A reasoning-gym task's own score_answer of the answer in <answer></answer> tags
    (reasoning_gym.utils.extract_answer, as the library's evaluation reads it): what
    rlray's reasoning_gym reward calls."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    scores = []
    for i, completion in enumerate(completions):
        config = json.loads(task_config[i])
        dataset = reasoning_gym.create_dataset(task[i], seed=0, size=1, **config)
        entry = {"question": question[i], "answer": answer[i], "metadata": json.loads(metadata[i])}
        scores.append(float(dataset.score_answer(extract_answer(text(completion)), entry)))
    return scores


REWARDS = {"exact_match": exact_match, "reasoning_gym": reasoning_gym_score}


class Clock(TrainerCallback):
    """Marks each step's end, evaluates every `eval_every` steps off the clock, and stops
    the run once `budget_s` seconds of training have passed (after an evaluation)."""

    def __init__(self, spec: dict, tokenizer):
        self.spec = spec
        self.tokenizer = tokenizer
        self.updates_per_step = spec["epochs"] * spec["episodes_per_step"] // spec["minibatch_size"]
        self.started = 0.0
        self.paused = 0.0
        self.steps: list[dict] = []  # step, seconds
        self.evals: list[dict] = []  # step, episodes, seconds, accuracy

    def seconds(self) -> float:
        return time.perf_counter() - self.started - self.paused

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.started = time.perf_counter()
        if self.spec["eval_every"]:
            self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.updates_per_step:
            return control
        step = state.global_step // self.updates_per_step
        self.steps.append({"step": step, "seconds": self.seconds()})
        over_budget = self.seconds() >= self.spec["budget_s"]
        if self.spec["eval_every"] and (step % self.spec["eval_every"] == 0 or over_budget):
            self.evaluate(model, step)
        if over_budget:
            control.should_training_stop = True
        return control

    def evaluate(self, model, step: int) -> None:
        """Greedy held-out accuracy (the share of greedy completions that score 1),
        batched, left-padded; its time is not training time."""
        paused = time.perf_counter()
        rows = self.spec["eval"]
        prompts = [
            r["prompt"]
            if isinstance(r["prompt"], str)
            else self.tokenizer.apply_chat_template(
                r["prompt"], add_generation_prompt=True, tokenize=False
            )
            for r in rows
        ]
        chat = not isinstance(rows[0]["prompt"], str)  # a rendered chat holds its specials
        inputs = self.tokenizer(
            prompts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=not chat,
        )
        was_training = model.training
        model.eval()
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=self.spec["max_new_tokens"],
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
            )
        model.train(was_training)
        texts = self.tokenizer.batch_decode(
            output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        )
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
        scores = REWARDS[self.spec["reward"]](prompts, texts, **columns)
        accuracy = sum(score >= 1.0 for score in scores) / len(prompts)
        self.paused += time.perf_counter() - paused
        self.evals.append(
            {
                "step": step,
                "episodes": step * self.spec["episodes_per_step"],
                "seconds": self.seconds(),
                "accuracy": accuracy,
            }
        )
        print(f"trl step {step}: {self.seconds():.1f} s, held-out {accuracy:.3f}", flush=True)


def grpo_config(spec: dict, out: Path) -> GRPOConfig:
    """GRPO with TRL's defaults (loss 'dapo', group-scaled rewards, beta 0, clip 0.2)
    except what makes a step equal to rlray's: episodes, group size, mini-batches,
    epochs, completion length, learning rate held constant, fp32."""
    per_generation = spec["episodes_per_step"] // spec["minibatch_size"]
    extra = {"min_new_tokens": spec["min_new_tokens"]} if spec["min_new_tokens"] else None
    return GRPOConfig(
        output_dir=str(out),
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        seed=spec["seed"],
        num_generations=spec["group_size"],
        per_device_train_batch_size=spec["minibatch_size"],
        gradient_accumulation_steps=1,
        steps_per_generation=per_generation,  # generation batch: episodes_per_step
        num_iterations=spec["epochs"],
        max_completion_length=spec["max_new_tokens"],
        generation_kwargs=extra,
        temperature=spec["temperature"],
        max_steps=spec["steps"] * spec["epochs"] * per_generation,
        shuffle_dataset=False,  # the prompts in the order rlray sees them
        # TRL's default recomputes activations to save GPU memory; rlray's learner does
        # not, so neither does TRL here: both sides do the same work.
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        disable_tqdm=True,
    )


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that adds up the seconds it spends generating and scoring a batch."""

    generation_seconds = 0.0

    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.generation_seconds += time.perf_counter() - started


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    dataset = Dataset.from_list(spec["train"])
    clock = Clock(spec, tokenizer)
    trainer = TimedGRPOTrainer(
        model=spec["model_path"],
        reward_funcs=REWARDS[spec["reward"]],
        args=grpo_config(spec, Path(result_path).parent / "trl-output"),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    steps = clock.steps[-1]["step"] if clock.steps else 0
    Path(result_path).write_text(
        json.dumps(
            {
                "evals": clock.evals,
                "steps": clock.steps,
                "episodes": steps * spec["episodes_per_step"],
                "seconds": clock.steps[-1]["seconds"] if clock.steps else 0.0,
                "generation_seconds": trainer.generation_seconds,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
