"""The learner's engine in bfloat16 against float32 on the same float32 weights: how far
the logprobs move, and the training speed and memory of each.

    python benchmarks/learner_dtype.py --device cuda        # on a GPU machine
    python benchmarks/learner_dtype.py --device cpu --sizes tiny
    python benchmarks/learner_dtype.py --device cuda --sizes 100m 1b --compile  # and compiled
    python benchmarks/learner_dtype.py --dtypes bfloat16 --micro-batch-tokens 0 2048 18432

`--compile` adds, for each dtype, the engine with its decoder layers compiled
(`learner.compile`); its first (warm-up) update pays the compilation, which is not timed.
`--micro-batch-tokens` times each engine with micro-batches of at most that many tokens
(`learner.micro_batch_tokens`; 0, the default, is micro-batches of 16 sequences).

Random-weight Qwen2 models (tied embeddings) built here: `tiny` (0.5M parameters, the
embedded model's shape, 8 completion tokens) and `100m` (138M parameters, 256 completion
tokens); 64 sequences of random tokens with 32-token prompts. bfloat16 is the engine's
mixed precision: float32 master weights and AdamW state, bfloat16 autocast arithmetic.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.algorithms import rl_math as rm
from rlray.learner.batches import TokenBatch, collate
from rlray.learner.engine import Engine
from rlray.learner.engine_settings import EngineSettings

# name: (hidden, layers, heads, vocab, completion tokens)
SIZES = {
    "tiny": (128, 2, 2, 20, 8),
    "100m": (768, 12, 12, 32000, 256),
    "1b": (2048, 16, 16, 32000, 256),  # benchmarks/colocated_turns.py's larger model
}
SEQUENCES, PROMPT = 64, 32


def build(name: str, out: str) -> int:
    """Saves a random Qwen2 of the named size into `out`; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, vocab, _ = SIZES[name]
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def random_batch(
    name: str, device: str, sequences: int = SEQUENCES, steps: int | None = None
) -> TokenBatch:
    """Returns `sequences` random completions (of the size's length, or `steps` tokens)
    of one random prompt."""
    *_, vocab, size_steps = SIZES[name]
    steps = steps or size_steps
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (PROMPT,), generator=generator).tolist()] * sequences
    completions = [torch.randint(0, vocab, (steps,), generator=generator).tolist() for _ in prompts]
    return collate(prompts, completions, 0).to(torch.device(device))


def train_speed(engine: Engine, batch: TokenBatch, repeats: int = 3) -> float:
    """Returns tokens/s of one epoch of PPO updates on the batch (one mini-batch)."""
    advantages = torch.randn(batch.size, device=batch.mask.device)[:, None] * batch.mask
    old_logp = engine.score(batch).logp

    def loss_fn(outputs, rows, totals):
        loss, _ = rm.ppo_token_loss(outputs.logp, old_logp[rows], advantages[rows], 0.2, 0.2)
        return rm.aggregate(loss, batch.mask[rows], "token_mean", totals.tokens), {}

    engine.train(batch, batch.mask, loss_fn, epochs=1, minibatch_size=batch.size)  # warm-up
    synchronize(batch)
    started = time.perf_counter()
    for _ in range(repeats):
        engine.train(batch, batch.mask, loss_fn, epochs=1, minibatch_size=batch.size)
    synchronize(batch)
    return int(batch.attention_mask.sum()) * repeats / (time.perf_counter() - started)


def synchronize(batch: TokenBatch) -> None:
    if batch.mask.is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="+", default=["tiny", "100m"], choices=list(SIZES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true", help="also time compiled layers")
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    for name in args.sizes:
        out = tempfile.mkdtemp()
        parameters = build(name, out)
        batch = random_batch(name, args.device)
        gap = logprob_gap(out, batch, args.device)
        outside = (gap > torch.log(torch.tensor(2.0))).float().mean()
        print(
            f"{name}: {parameters / 1e6:.1f}M parameters, {SIZES[name][-1]} completion tokens: "
            f"|bf16 - fp32| logprob mean {gap.mean():.2e}, max {gap.max():.2e}, "
            f"ratio outside [0.5, 2] {outside:.2e}"
        )
        for dtype in args.dtypes:
            for compiled in (False, True) if args.compile else (False,):
                for budget in args.micro_batch_tokens:
                    print_training(out, batch, dtype, compiled, args.device, budget)


def print_training(
    model: str, batch: TokenBatch, dtype: str, compiled: bool, device: str, budget: int = 0
) -> None:
    """Prints one engine's training tokens/s and, on a GPU, its peak memory, in
    micro-batches of at most `budget` tokens, or of 16 sequences."""
    if batch.mask.is_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    settings = EngineSettings(
        dtype=dtype,
        device=device,
        micro_batch_size=SEQUENCES if budget else 16,  # a budget: it alone binds
        micro_batch_tokens=budget,
        compile_layers=compiled,
    )
    engine = Engine(model, settings)
    started = time.perf_counter()
    speed = train_speed(engine, batch)
    memory = torch.cuda.max_memory_allocated() / 2**30 if batch.mask.is_cuda else None
    shown = f", peak GPU memory {memory:.2f} GiB" if memory is not None else ""
    label = f"{dtype} compiled" if compiled else dtype
    label += f", {budget} tokens" if budget else ", 16 sequences"
    elapsed = time.perf_counter() - started
    print(
        f"  {label:34s} training {speed:10,.0f} tokens/s{shown} ({elapsed:.0f} s in all)",
        flush=True,
    )


def logprob_gap(model: str, batch: TokenBatch, device: str) -> torch.Tensor:
    """Returns |float32 - bfloat16| logprobs of the batch's tokens, (B, T)."""
    logprobs = [
        Engine(model, EngineSettings(dtype=dtype, device=device, micro_batch_size=16))
        .score(batch)
        .logp
        for dtype in ("float32", "bfloat16")
    ]
    return (logprobs[0] - logprobs[1]).abs().cpu()


if __name__ == "__main__":
    main()
