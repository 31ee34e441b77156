"""A learner step with one update: its logprobs before the update taken from the update's
own forward pass (fused) against a pass of their own, side by side in one process.

    python benchmarks/learner_step.py                      # 12.6M parameters, 64 x 256 tokens
    python benchmarks/learner_step.py --size 0.5M --tokens 64 --episodes 256
    python benchmarks/learner_step.py --device cuda --dtype bfloat16 --size 100M  # on a GPU

The random-weight models of benchmarks/vs_trl.py (the embedded model's shape family,
character vocabulary). Each repeat runs one step of each kind on the same episodes from
the same weights, in turn, so that both see the same machine; the first repeat is
warm-up. Prints the median seconds of each and their ratio, and checks that both made
the same update.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_trl import SIZES, random_model

from rlray.config import Config
from rlray.core.episode import Episode
from rlray.learner.rl import Learner


def learner(
    model: str, episodes: int, tokens: int, device: str = "cpu", dtype: str = "float32"
) -> Learner:
    config = Config()
    config.model.dtype = dtype  # type: ignore[assignment]
    config.learner.epochs = 1
    config.learner.episodes_per_step = config.learner.minibatch_size = episodes
    config.learner.micro_batch_size = min(episodes, 64)
    config.model.max_model_len = tokens + 16
    return Learner(
        model,
        config.model,
        config.algorithm,
        config.learner,
        max_new_tokens=tokens,
        samples_per_prompt=config.rollout.samples_per_prompt,
        temperature=1.0,
        seed=0,
        device=device,
    )


def random_episodes(
    count: int, tokens: int, vocab: int, samples: int, shortest: int = 0
) -> list[Episode]:
    """Returns groups of `samples` episodes of random tokens, half rewarded: completions
    of `tokens` tokens, or of `shortest` to `tokens` (uniformly drawn) if given.

    Token ids are drawn from 1 to vocab - 1. Id 0 is the character tokenizer's padding,
    whose embedding row a random model holds at zero. A prompt that starts with it
    keeps an all-zero hidden state through every layer, where RMSNorm's backward
    multiplies the gradient by 1/sqrt(eps) at each norm: the gradient norm overflows."""
    rng = random.Random(0)
    return [
        Episode(
            run_id="bench",
            episode_id=f"bench-{i}",
            prompt_index=i // samples,
            sample_index=i % samples,
            prompt="12+34=",
            completion="",
            prompt_token_ids=[rng.randrange(1, vocab) for _ in range(8)],
            completion_token_ids=[
                rng.randrange(1, vocab) for _ in range(rng.randint(shortest or tokens, tokens))
            ],
            rollout_logprobs=[],
            finish_reason="stop" if shortest else "length",
            policy_version=0,
            rollout_worker="bench",
            reward=float(i % 2),
        )
        for i in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10M", choices=list(SIZES))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    model, params = random_model(args.size, args.tokens)
    torch.manual_seed(0)
    fused, apart = (
        learner(model, args.episodes, args.tokens, args.device, args.dtype) for _ in range(2)
    )
    apart.fuse_old_logprobs = False
    assert fused.fuses_old_logprobs(args.episodes) and not apart.fuses_old_logprobs(args.episodes)
    vocab = fused.limits.vocab_size
    seconds: dict[str, list[float]] = {"fused": [], "own pass": []}
    for repeat in range(args.repeats + 1):
        for name, one in (("fused", fused), ("own pass", apart)):
            episodes = random_episodes(args.episodes, args.tokens, vocab, 4)
            started = time.perf_counter()
            one.train_step(episodes)
            if repeat:  # the first is warm-up
                seconds[name].append(time.perf_counter() - started)
    gap = max(
        float((a - b).abs().max())
        for a, b in zip(
            fused.engine.policy.parameters(), apart.engine.policy.parameters(), strict=True
        )
    )
    tokens = args.episodes * args.tokens
    print(f"{args.size} ({params / 1e6:.1f}M), {args.episodes} x {args.tokens} tokens, "
          f"{args.dtype} on {args.device}, torch threads {torch.get_num_threads()}, "
          f"{args.repeats} steps each")  # fmt: skip
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"  {name:9s} {median:6.2f} s a step, {tokens / median:7.0f} tokens/s")
    ratio = statistics.median(seconds["own pass"]) / statistics.median(seconds["fused"])
    print(f"  fused is {ratio:.2f}x as fast; largest weight difference after the steps {gap:.1e}")


if __name__ == "__main__":
    main()
