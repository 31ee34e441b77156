"""A rollout process's memory over a default job's batches, under settings side by side:
oneDNN's primitive cache (vLLM's CPU linear layers are oneDNN matmuls), the heap given
back after each batch or kept (rlray.rollout.worker.heap_trimmer), and generation against
weight loads.

    python benchmarks/rollout_memory.py                  # 100 batches, each setting in turn
    python benchmarks/rollout_memory.py --batches 150 --capacities 1024 16 --heap kept

Each setting runs in a fresh process started with a rollout actor's environment
(rlray.rollout.worker.VLLM_ENV, glibc's settings included): a RolloutWorker on the
embedded model generates the default job's batches (64 prompts x 4 samples, with
logprobs) one after another, and with --loads loads the same weights after each. Prints
the peak anonymous memory and PSS (/proc/self/smaps_rollup) and the seconds of the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlray.rollout.worker import VLLM_ENV  # noqa: E402


def memory_mib() -> tuple[float, float]:
    """(anonymous, PSS) memory of this process in MiB."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return fields["Pss_Anon"] / 1024, fields["Pss"] / 1024


def child(batches: int, generate: bool, load: bool, keep_heap: bool) -> None:
    """Runs the loop in this process and prints its result as JSON."""
    from transformers import AutoModelForCausalLM

    from rlray.config import Config
    from rlray.data.models import resolve_model_path
    from rlray.data.prompts import train_prompts
    from rlray.rollout.worker import RolloutWorker
    from rlray.weights.packing import tied_output_name, weights_for_vllm

    config = Config()
    path = resolve_model_path(config.model.path)
    worker = RolloutWorker("rollout-0", path, config.model, config.rollout, "memory", 0)
    if keep_heap:
        worker.trim_heap = None
    model = AutoModelForCausalLM.from_pretrained(path)
    architecture = worker.llm.model_config.architecture
    weights = weights_for_vllm(dict(model.state_dict()), tied_output_name(model), architecture)
    prompts, size = train_prompts(config.data, 0), config.rollout.prompts_per_batch
    start = memory_mib()
    peak = start
    started = time.perf_counter()
    for batch in range(batches):
        if generate:
            worker.generate([prompts.row(batch * size + i) for i in range(size)], batch * size)
        if load:
            worker.load_weights(batch + 1, weights)
        peak = max(peak, memory_mib())
    seconds = time.perf_counter() - started
    print(json.dumps({"start": start, "peak": peak, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--capacities", type=int, nargs="+", default=[1024, 16, 128])
    parser.add_argument("--loads", action="store_true", help="also load weights after each")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-generate", action="store_true", help="weight loads alone")
    parser.add_argument(
        "--heap", nargs="+", choices=["given back", "kept"], default=["given back", "kept"]
    )
    parser.add_argument("--keep-heap", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.batches, not args.no_generate, args.loads or args.no_generate, args.keep_heap)
        return
    print(f"{args.batches} batches; oneDNN primitive cache capacity (1024: oneDNN's default)")
    for capacity in args.capacities:
        for heap in args.heap:
            # vllm_env sets the capacity only where the variable is unset.
            env = {**os.environ, **VLLM_ENV, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(capacity)}
            command = [sys.executable, __file__, "--child", "--batches", str(args.batches)]
            command += ["--loads"] * args.loads + ["--no-generate"] * args.no_generate
            command += ["--keep-heap"] * (heap == "kept")
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            (anon, pss), (start_anon, _) = result["peak"], result["start"]
            print(
                f"  capacity {capacity:5d}, heap {heap:10s}: anonymous {start_anon:.0f} -> "
                f"peak {anon:.0f} MiB, PSS peak {pss:.0f} MiB, loop {result['seconds']:.1f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
