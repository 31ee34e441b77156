"""The learner group at N = 1 and N = 2: training tokens/s of the whole group and the
memory each learner process holds, on the same batch, side by side in one run.

    python benchmarks/learner_scaling.py                       # tiny and 100m, on CPU
    python benchmarks/learner_scaling.py --device cuda --sizes 100m --workers 1 2

Each learner is a process of one torch.distributed group (gloo on CPU, NCCL on GPU)
running rlray's Engine, which shards its model, gradients and AdamW state with FSDP2
when the group has more than one learner and splits every pass by tokens. Models are
benchmarks/learner_dtype.py's random Qwen2s: `tiny` (the embedded model's shape) and
`100m` (138M parameters). Reported per learner: the bytes of its own parameters and
AdamW state (what sharding divides), and its process's peak resident memory, which
includes loading the whole model before it is sharded.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learner_dtype import SIZES, build, random_batch, train_speed

from rlray.learner import distributed as dd
from rlray.learner.engine import Engine
from rlray.learner.engine_settings import EngineSettings


def local_bytes(tensors) -> int:
    """Bytes of this learner's part of the tensors (its shard of a DTensor)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def learner(rank: int, world_size: int, port: int, model: str, args, out: str) -> None:
    """One learner of the group: trains, then reports its speed and memory."""
    torch.set_num_threads(max(1, args.threads // world_size))
    if world_size > 1:
        dd.join_group(rank, world_size, "127.0.0.1", port, args.device, timeout_s=600)
    engine = Engine(model, EngineSettings(device=args.device, micro_batch_size=args.micro_batch))
    batch = random_batch(args.size, args.device, args.sequences, args.completion)
    speed = train_speed(engine, batch, repeats=args.repeats)
    state = [s for group in engine.optimizer.state.values() for s in group.values()]
    report = {
        "tokens_per_s": speed,
        "parameters_gib": local_bytes(engine.policy.parameters()) / 2**30,
        "adamw_gib": local_bytes(t for t in state if t.dim() > 0) / 2**30,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if args.device == "cuda":
        report["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    torch.save(report, f"{out}.{rank}")
    if world_size > 1:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="+", default=["tiny", "100m"], choices=list(SIZES))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--completion", type=int, default=64, help="tokens per completion")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    hf_logging.disable_progress_bar()  # each model save would print a bar
    for size in args.sizes:
        model = tempfile.mkdtemp()
        parameters = build(size, model)
        tokens = args.sequences * (32 + args.completion)
        print(f"{size}: {parameters / 1e6:.1f}M parameters, {tokens} tokens per update")
        speeds = {}
        for world_size in args.workers:
            out = str(Path(tempfile.mkdtemp()) / "report")
            run = (world_size, dd.free_port(), model, argparse.Namespace(**vars(args), size=size))
            mp.spawn(learner, (*run, out), nprocs=world_size)
            reports = [torch.load(f"{out}.{rank}") for rank in range(world_size)]
            speeds[world_size] = reports[0]["tokens_per_s"]
            gpu = [r.get("peak_gpu_gib") for r in reports]
            print(
                f"  N={world_size}: {speeds[world_size]:8,.0f} tokens/s (group), per learner: "
                f"parameters {max(r['parameters_gib'] for r in reports):.3f} GiB, "
                f"AdamW {max(r['adamw_gib'] for r in reports):.3f} GiB, "
                f"peak RSS {max(r['peak_rss_gib'] for r in reports):.2f} GiB"
                + (f", peak GPU {max(gpu):.2f} GiB" if gpu[0] is not None else ""),
                flush=True,
            )
        first = args.workers[0]
        for world_size in args.workers[1:]:
            ratio = speeds[world_size] / speeds[first]
            print(f"  N={world_size} / N={first} tokens/s: {ratio:.2f}")


if __name__ == "__main__":
    main()
