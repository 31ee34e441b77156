"""A learner step on episodes of very different lengths: micro-batches padded to the
batch's longest episode (rlray before bucketing; PaddedMicroBatching below) against
micro-batches of like lengths, each on its own columns, by rows and by a token budget;
side by side in one process.

    python benchmarks/padding.py                        # 12.6M, 64 episodes of 8-256 tokens
    python benchmarks/padding.py --size 0.5M --episodes 256 --budget 4096
    python benchmarks/padding.py --device cuda --dtype bfloat16 --size 100M --longest 2048 \
        --budget 32768                                  # on a GPU machine

The random-weight models of benchmarks/vs_trl.py. Completion lengths are drawn
uniformly from --shortest to --longest tokens (a reasoning task's long tail), one update
per step. Each repeat runs one step of each kind on the same episodes from the same
weights, in turn; the first repeat is warm-up. Prints the median seconds, the learner's
real tokens/s and the padding share of each, and checks that all made the same update.
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

from rlray.learner.batches import MicroBatching, TokenBatch
from rlray.learner.rl import Learner


class PaddedMicroBatching(MicroBatching):
    """Micro-batches as rlray made them before bucketing: rows in the mini-batch's
    (shuffled) order, each micro-batch on every column of the batch, so that a row pads
    to the batch's longest episode."""

    def order(
        self,
        rows: list[int],
        prompt: list[int],
        completion: list[int],
        groups: list[int] | None,
    ) -> list[int]:
        return rows

    def take(self, batch: TokenBatch, rows: torch.Tensor) -> TokenBatch:
        return batch.rows(rows)


def kinds(model: str, args: argparse.Namespace) -> dict[str, Learner]:
    """The three learners, on the same weights: padded, bucketed by rows, by tokens."""
    padded, by_rows, by_tokens = (
        learner(model, args.episodes, args.longest, args.device, args.dtype) for _ in range(3)
    )
    # Rows alone bound these two (the CPU's default token budget would split them too).
    padded.engine.micro_batching = PaddedMicroBatching(max_rows=args.rows)
    by_rows.engine.micro_batching.max_rows = args.rows
    by_rows.engine.micro_batching.max_tokens = 0
    by_tokens.engine.micro_batching.max_tokens = args.budget
    return {
        f"padded, {args.rows} rows": padded,
        f"like lengths, {args.rows} rows": by_rows,
        f"like lengths, {args.budget} tokens": by_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10M", choices=list(SIZES))
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--shortest", type=int, default=8)
    parser.add_argument("--longest", type=int, default=256)
    parser.add_argument("--rows", type=int, default=16, help="micro_batch_size")
    parser.add_argument("--budget", type=int, default=4096, help="micro_batch_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    model, params = random_model(args.size, args.longest)
    torch.manual_seed(0)
    learners = kinds(model, args)
    vocab = next(iter(learners.values())).limits.vocab_size
    seconds: dict[str, list[float]] = {name: [] for name in learners}
    padding: dict[str, float] = {}
    peak_gib: dict[str, float] = dict.fromkeys(learners, 0.0)
    tokens = 0
    for repeat in range(args.repeats + 1):
        for name, one in learners.items():
            episodes = random_episodes(args.episodes, args.longest, vocab, 4, args.shortest)
            tokens = sum(len(e.prompt_token_ids) + len(e.completion_token_ids) for e in episodes)
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            metrics = one.train_step(episodes)  # its metrics are floats: the step has ended
            if repeat:  # the first is warm-up
                seconds[name].append(time.perf_counter() - started)
            if args.device == "cuda":
                peak = torch.cuda.max_memory_allocated() / 2**30
                peak_gib[name] = max(peak_gib[name], peak)
            padding[name] = metrics.learner_padding_tokens / metrics.learner_tokens_computed
    weights = [list(one.engine.policy.parameters()) for one in learners.values()]
    gap = max(
        float((a - b).abs().max())
        for other in weights[1:]
        for a, b in zip(weights[0], other, strict=True)
    )
    print(f"{args.size} ({params / 1e6:.1f}M), {args.episodes} episodes of "
          f"{args.shortest}-{args.longest} completion tokens, "
          f"{args.dtype} on {args.device}, torch threads {torch.get_num_threads()}, "
          f"{args.repeats} steps each")  # fmt: skip
    base = statistics.median(next(iter(seconds.values())))
    for name, values in seconds.items():
        median = statistics.median(values)
        memory = f", peak GPU memory {peak_gib[name]:.2f} GiB" if args.device == "cuda" else ""
        print(f"  {name:26s} {median:6.2f} s a step, {tokens / median:7.0f} tokens/s, "
              f"padding {padding[name]:.0%}, {base / median:.2f}x{memory}")  # fmt: skip
    print(f"  largest weight difference after the steps {gap:.1e}")


if __name__ == "__main__":
    main()
