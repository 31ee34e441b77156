"""A learner step (one update) on the CPU by micro-batch size: the same episodes split
into micro-batches of at most N tokens (learner.micro_batch_tokens), side by side in one
process, on one thread as a disaggregated learner has.

    python benchmarks/micro_batches.py                         # 12.6M, 64 x 256 tokens
    python benchmarks/micro_batches.py --size 100M --episodes 16 --budgets 0 1100 2200
    python benchmarks/micro_batches.py --compile               # compiled decoder layers

The random-weight models of benchmarks/vs_trl.py. Budget 0 is micro_batch_size 64
episodes (the whole step of 64 at once). Each repeat runs one step of every budget in
turn on the same episodes, so that all see the same machine; the first repeat is
warm-up (and compiles). Prints the median seconds a step of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_step import learner, random_episodes
from vs_trl import SIZES, random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10M", choices=list(SIZES))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1100, 2200, 4400, 0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="compiled decoder layers")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, params = random_model(args.size, args.tokens)
    budgets = sorted(args.budgets, key=lambda b: b or 10**9)
    learners = {}
    for budget in budgets:
        one = learner(model, args.episodes, args.tokens)
        one.engine.micro_batching.max_tokens = budget
        if args.compile:
            from rlray.learner.models import compile_decoder_layers  # torch is loaded here

            compile_decoder_layers(one.engine.policy)
        learners[budget] = one
    vocab = learners[budgets[0]].limits.vocab_size
    seconds: dict[int, list[float]] = {b: [] for b in budgets}
    for repeat in range(args.repeats + 1):
        for budget, one in learners.items():
            episodes = random_episodes(args.episodes, args.tokens, vocab, 4)
            started = time.perf_counter()
            one.train_step(episodes)
            if repeat:  # the first is warm-up
                seconds[budget].append(time.perf_counter() - started)
    kind = "compiled" if args.compile else "eager"
    print(f"{args.size} ({params / 1e6:.1f}M), {args.episodes} x {args.tokens} tokens, {kind}, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} steps each")  # fmt: skip
    fastest = min(statistics.median(v) for v in seconds.values())
    for budget, values in seconds.items():
        median = statistics.median(values)
        name = f"{budget} tokens" if budget else f"{min(args.episodes, 64)} episodes"
        print(
            f"  micro-batches of {name:12s} {median:6.2f} s a step "
            f"({median / fastest:.2f}x the fastest's time)"
        )


if __name__ == "__main__":
    main()
