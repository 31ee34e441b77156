"""The learner's half of the colocated placement's turns on one device: what it holds
during the engine's turn, with and without learner.offload_optimizer, and what a turn
costs.

    python benchmarks/colocated_turns.py --device cuda --sizes 100m 1b   # on a GPU machine
    python benchmarks/colocated_turns.py --device cpu --sizes tiny       # the code path

Random-weight Qwen2 models of benchmarks/learner_dtype.py (100m: 138M parameters, 1b:
1.1B), bfloat16 compute on float32 master weights, 64 sequences of 32 + 256 tokens, one
PPO update per step. For each turn it prints the learner's allocated memory, the device
memory free to a waking engine (`torch.cuda.mem_get_info`: what vLLM's wake-up maps),
and the seconds of the release (the engine's turn) and of the reclaim (the learner's).
The engine itself (vLLM's sleep and wake-up) is not in this script, so that it runs on
GPU machines without vLLM.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learner_dtype import SIZES, build, random_batch

from rlray.algorithms import rl_math as rm
from rlray.learner.batches import TokenBatch
from rlray.learner.engine import Engine
from rlray.learner.engine_settings import EngineSettings

GIB = 2**30


def one_step(engine: Engine, batch: TokenBatch) -> None:
    """One PPO update on the whole batch (the step the learner's turn runs)."""
    advantages = torch.randn(batch.size, device=batch.mask.device)[:, None] * batch.mask
    old_logp = engine.score(batch).logp

    def loss_fn(outputs, rows, totals):
        loss, _ = rm.ppo_token_loss(outputs.logp, old_logp[rows], advantages[rows], 0.2, 0.2)
        return rm.aggregate(loss, batch.mask[rows], "token_mean", totals.tokens), {}

    engine.train(batch, batch.mask, loss_fn, epochs=1, minibatch_size=batch.size)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_memory(device: str) -> tuple[float, float]:
    """(allocated by torch, free on the device) in GiB; zeros on CPU."""
    if device != "cuda":
        return 0.0, 0.0
    return torch.cuda.memory_allocated() / GIB, torch.cuda.mem_get_info()[0] / GIB


def turns(engine: Engine, batch: TokenBatch, device: str, offload: bool, repeats: int) -> dict:
    """Runs `repeats` learner turns (a step) and engine turns (the release) in turn."""
    seconds: dict[str, list[float]] = {"step": [], "release": [], "reclaim": []}
    memory = {}
    for _ in range(repeats):
        started = time.perf_counter()
        engine.reclaim_device()
        synchronize(device)
        seconds["reclaim"].append(time.perf_counter() - started)
        started = time.perf_counter()
        one_step(engine, batch)
        synchronize(device)
        seconds["step"].append(time.perf_counter() - started)
        memory["learner_turn"] = device_memory(device)
        started = time.perf_counter()
        engine.release_device(offload_optimizer=offload)
        synchronize(device)
        seconds["release"].append(time.perf_counter() - started)
        memory["engine_turn"] = device_memory(device)
    return {"seconds": {k: statistics.median(v) for k, v in seconds.items()}, "memory": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="+", default=["100m", "1b"], choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name in args.sizes:
        out = tempfile.mkdtemp()
        started = time.perf_counter()
        parameters = build(name, out)
        print(
            f"{name}: {parameters / 1e6:.0f}M parameters (built in "
            f"{time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        batch = random_batch(name, args.device)
        engine = Engine(
            out, EngineSettings(dtype="bfloat16", device=args.device, micro_batch_size=16)
        )
        one_step(engine, batch)  # warm-up: the optimizer's state exists from here
        results = {}
        for offload in (False, True, False):  # the first plain pass warms the kernels again
            results[offload] = turns(engine, batch, args.device, offload, args.repeats)
        moments = sum(
            t.numel() * t.element_size()
            for state in engine.optimizer.state.values()
            for key, t in state.items()
            if key != "step"
        )
        print(f"  AdamW moments {moments / GIB:.2f} GiB")
        for offload, result in results.items():
            (held, free), (kept, freed) = (
                result["memory"]["learner_turn"],
                result["memory"]["engine_turn"],
            )
            s = result["seconds"]
            print(
                f"  offload_optimizer {str(offload).lower():5s}: learner's turn holds "
                f"{held:.2f} GiB ({free:.1f} free); engine's turn: learner holds {kept:.2f} "
                f"GiB, {freed:.1f} GiB free; step {s['step']:.3f} s, release "
                f"{s['release']:.3f} s, reclaim {s['reclaim']:.3f} s",
                flush=True,
            )
        plain, moved = results[False], results[True]
        gained = moved["memory"]["engine_turn"][1] - plain["memory"]["engine_turn"][1]
        cost = moved["seconds"]["release"] + moved["seconds"]["reclaim"]
        print(
            f"  offload: +{gained:.2f} GiB free for the engine, {cost:.3f} s a step "
            f"({cost / plain['seconds']['step']:.1%} of the step)",
            flush=True,
        )
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
