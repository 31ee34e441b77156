"""A learner step on groups that share their prompts: each distinct prompt run once for
its group (`Engine.share_prompts`, the default) against every row run whole, side by side
in one process.

    python benchmarks/shared_prompts.py                    # the default task's shape
    python benchmarks/shared_prompts.py --micro-batch-size 256 --threads 2
    python benchmarks/shared_prompts.py --micro-batch-sizes 64 256   # each prompt once, by rows

The embedded tiny model and the default job's learner settings (one update a step,
micro-batches of at most 64 episodes and 2048 tokens). A step is 64 prompts "a+b=" with
4 answers each (the right one or one off, 2-4 tokens with the end of sequence), half
rewarded. Each repeat runs one step of each kind on the same episodes from the same
weights, in turn; the first repeat is warm-up. Prints the median seconds of each, the
positions its learner computed, and the largest weight difference after the steps.
With --micro-batch-sizes, each prompt runs once and the kinds are micro-batches of at
most that many episodes (and 2048 tokens), against the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_step import learner

from rlray.config import Config
from rlray.core.episode import Episode
from rlray.data.models import resolve_model_path
from rlray.learner.rl import Learner

PROMPTS, SAMPLES = 64, 4


def default_learner(micro_batch_size: int) -> Learner:
    """The embedded model's learner, one update on a whole step."""
    one = learner(resolve_model_path(Config().model.path), PROMPTS * SAMPLES, tokens=8)
    one.engine.micro_batch_size = micro_batch_size
    return one


def default_task_step(tokenizer, rng: random.Random) -> list[Episode]:
    """A step of the default task's shape: PROMPTS sums, SAMPLES answers to each."""
    episodes = []
    for prompt_index in range(PROMPTS):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt = f"{a}+{b}="
        for sample in range(SAMPLES):
            answer = str(a + b + rng.choice([0, 0, 1, -1]))
            episodes.append(
                Episode(
                    run_id="bench",
                    episode_id=f"bench-{prompt_index}-{sample}",
                    prompt_index=prompt_index,
                    sample_index=sample,
                    prompt=prompt,
                    completion=answer,
                    prompt_token_ids=tokenizer(prompt).input_ids,
                    completion_token_ids=[*tokenizer(answer).input_ids, tokenizer.eos_token_id],
                    rollout_logprobs=[],
                    finish_reason="stop",
                    policy_version=0,
                    rollout_worker="bench",
                    reward=float(sample % 2),
                )
            )
    return episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the learner's)")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", help="compare these")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.micro_batch_sizes:
        sizes = args.micro_batch_sizes
        kinds = {f"at most {n} episodes": default_learner(n) for n in sizes}
        base_name, bound = next(iter(kinds)), "/".join(map(str, sizes))
    else:
        kinds = {"each prompt once": default_learner(args.micro_batch_size)}
        kinds["every row whole"] = default_learner(args.micro_batch_size)
        kinds["every row whole"].engine.share_prompts = False
        base_name, bound = "every row whole", str(args.micro_batch_size)
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    computed: dict[str, int] = {}
    for repeat in range(args.repeats + 1):
        step = default_task_step(next(iter(kinds.values())).tokenizer, random.Random(repeat))
        for name, one in kinds.items():
            started = time.perf_counter()
            metrics = one.train_step([dataclasses.replace(e) for e in step])
            if repeat:  # the first is warm-up
                seconds[name].append(time.perf_counter() - started)
            computed[name] = metrics.learner_tokens_computed
    gap = max(
        float((a - b).detach().abs().max())
        for a, b in zip(*(one.engine.policy.parameters() for one in kinds.values()), strict=True)
    )
    print(f"{PROMPTS} prompts x {SAMPLES} samples a step, micro-batches of at most "
          f"{bound} episodes and 2048 tokens, torch threads {args.threads}, "
          f"{args.repeats} steps each")  # fmt: skip
    base = statistics.median(seconds[base_name])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"  {name:21s} {median * 1000:6.1f} ms a step, {computed[name]} positions "
              f"computed, {base / median:.2f}x")  # fmt: skip
    print(f"  largest weight difference after the steps {gap:.1e}")


if __name__ == "__main__":
    main()
