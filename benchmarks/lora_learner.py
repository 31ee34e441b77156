"""The learner with LoRA adapters against full fine-tuning on a 138M-parameter model:
trainable parameters, AdamW state, peak memory, training tokens/s and the time to
publish the weights a rollout worker loads (LoRA: merged), side by side in one run.

    python benchmarks/lora_learner.py                      # rank 8, on CPU
    python benchmarks/lora_learner.py --ranks 8 64 --sequences 8

Each kind runs in a process of its own (so that each peak is its own), in turn, on
benchmarks/learner_dtype.py's random `100m` Qwen2 (138M parameters, tied embeddings):
one PPO update per pass on `--sequences` random completions of `--completion` tokens
after a 32-token prompt, micro-batches of 4, float32, torch's threads as this process
has them. The publish is `publishable_weights`, what a weight sync sends: the merged
model where adapters train, in float32 and in bfloat16.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_dtype import build, random_batch, train_speed

from rlray.learner.engine import Engine
from rlray.learner.engine_settings import EngineSettings
from rlray.weights.packing import publishable_weights

SIZE = "100m"


def measure(model: str, rank: int, sequences: int, completion: int) -> dict[str, float]:
    """In a process of its own: one learner's figures (see the module's docstring)."""
    engine = Engine(model, EngineSettings(micro_batch_size=4, lora_rank=rank))
    batch = random_batch(SIZE, "cpu", sequences, completion)
    tokens_per_s = train_speed(engine, batch, repeats=2)
    trainable = sum(p.numel() for p in engine.policy.parameters() if p.requires_grad)
    adamw = sum(
        t.numel() * t.element_size()
        for state in engine.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    publish = {}
    for dtype in (torch.float32, torch.bfloat16):
        seconds = []
        for _ in range(3):
            started = time.perf_counter()
            publishable_weights(engine.policy, dtype, keep=True)
            seconds.append(time.perf_counter() - started)
        publish[str(dtype).removeprefix("torch.")] = statistics.median(seconds)
    return {
        "trainable": trainable,
        "adamw_gib": adamw / 2**30,
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "tokens_per_s": tokens_per_s,
        "publish_float32_s": publish["float32"],
        "publish_bfloat16_s": publish["bfloat16"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8], help="0 is always run")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--completion", type=int, default=64, help="completion tokens")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        parameters = build(SIZE, tmp)
        print(f"{SIZE}: {parameters / 1e6:.1f}M parameters, {args.sequences} x "
              f"({32} + {args.completion}) tokens an update, float32, CPU")  # fmt: skip
        rows = {}
        for rank in [0, *args.ranks]:
            with context.Pool(1) as pool:
                rows[rank] = pool.apply(measure, (tmp, rank, args.sequences, args.completion))
    print("| kind | trainable parameters | AdamW state | peak RSS | training tokens/s | "
          "publish float32 / bfloat16 |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    full = rows[0]["tokens_per_s"]
    for rank, row in rows.items():
        kind = "full" if rank == 0 else f"LoRA rank {rank}"
        print(
            f"| {kind} | {row['trainable'] / 1e6:.2f}M | {row['adamw_gib']:.3f} GiB | "
            f"{row['peak_gib']:.2f} GiB | {row['tokens_per_s']:.0f} "
            f"({row['tokens_per_s'] / full:.2f}x) | {row['publish_float32_s']:.3f} / "
            f"{row['publish_bfloat16_s']:.3f} s |"
        )


if __name__ == "__main__":
    main()
