"""vLLM's CPU matmuls, oneDNN's against torch's (rollout.cpu_matmul), side by side.

vLLM's CPU build packs each linear layer's weights into a oneDNN matmul, compiled for
each batch size it meets, and packs them again at every weight load. A training run
loads weights after every step, and a batch of short completions meets new sizes at
every decode step. Two measurements, each setting in turn:

  job         the default job (jobs/ppo.py) with each setting, per seed: episodes/s and
              peak memory, and the ratio
  generation  a RolloutWorker alone (one thread): per cycle a weight load (the weights
              moved a little) and a batch of new prompts; median seconds of each

    python benchmarks/cpu_matmul.py job [--seeds 0 1 2]
    python benchmarks/cpu_matmul.py generation [--sizes default 10M 10M-long] [--cycles 6]

Sizes: default (the embedded 0.53M model, the default job's batch), 10M (a random 12.6M
Qwen2 on the same batch), 10M-long (that model, 64 completions of exactly 256 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETTINGS = ("onednn", "torch")


def job(seeds: list[int], out: Path) -> None:
    """Runs the default job with each setting in turn, per seed; prints the figures."""
    rows = []
    for seed in seeds:
        summaries = {}
        for setting in SETTINGS:
            run = out / f"{setting}-seed{seed}"
            if not (run / "summary.json").is_file():
                command = [sys.executable, str(REPO / "jobs" / "ppo.py"), "--seed", str(seed)]
                command += ["--rollout.cpu_matmul", setting, "--run-dir", str(run)]
                with open(out / f"{setting}-seed{seed}.log", "w") as log:
                    subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
            summaries[setting] = json.loads((run / "summary.json").read_text())
        rows.append((seed, summaries))
    print("seed | onednn episodes/s | torch episodes/s | torch / onednn | peak GiB onednn / torch")
    for seed, s in rows:
        old, new = s["onednn"], s["torch"]
        ratio = new["episodes_per_second"] / old["episodes_per_second"]
        print(
            f"{seed} | {old['episodes_per_second']:.1f} | {new['episodes_per_second']:.1f} | "
            f"{ratio:.2f} | {old['memory_peak_gib']:.2f} / {new['memory_peak_gib']:.2f}"
        )


def generation(sizes: list[str], cycles: int) -> None:
    """Times each size with each setting, in turn, each in a process of its own."""
    for size in sizes:
        results = {}
        for setting in SETTINGS:
            command = [sys.executable, __file__, "one", setting, size, str(cycles)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[setting] = json.loads(done.stdout.splitlines()[-1])
        line = [f"{size}:"]
        for setting, r in results.items():
            # The first cycle compiles and warms up: not counted.
            r["gen"], r["load"] = statistics.median(r["gen"][1:]), statistics.median(r["load"][1:])
            line.append(f"{setting} generation {r['gen']:.3f} s, load {1e3 * r['load']:.1f} ms;")
        ratio = results["onednn"]["gen"] / results["torch"]["gen"]
        line.append(f"torch / onednn speed: generation {ratio:.2f}x,")
        line.append(f"load {results['onednn']['load'] / results['torch']['load']:.2f}x")
        line.append(f"({results['torch']['tokens']} tokens a batch)")
        print(" ".join(line), flush=True)


def one(setting: str, size: str, cycles: int) -> None:
    """One RolloutWorker with the setting: per cycle a weight load and a batch."""
    from rlray.config import Config
    from rlray.rollout.worker import vllm_env

    config = Config()
    config.rollout.cpu_matmul = setting
    if size != "default":
        from rlray.data.tiny_models import random_char_model

        model = Path.home() / ".cache" / "rlray" / "bench-models" / "char-12.6M"
        if not (model / "config.json").is_file():
            random_char_model(model, hidden=256, layers=12, max_positions=512)
        config.model.path, config.model.max_model_len = str(model), 512
        if size == "10M-long":
            config.rollout.max_new_tokens = config.rollout.min_new_tokens = 256
            config.rollout.prompts_per_batch = 16
    os.environ.update(vllm_env(config.rollout))
    import torch  # after vllm_env, as in a rollout process
    from transformers import AutoModelForCausalLM

    from rlray.data.models import resolve_model_path
    from rlray.data.prompts import train_prompts
    from rlray.rollout.worker import RolloutWorker

    torch.set_num_threads(1)  # a rollout actor's one CPU
    path = resolve_model_path(config.model.path)
    worker = RolloutWorker("bench", path, config.model, config.rollout, "bench", seed=0)
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    prompts, per_batch = train_prompts(config.data, 0), config.rollout.prompts_per_batch
    gen, load, tokens = [], [], 0
    for cycle in range(cycles):
        weights = {k: v + 1e-4 * torch.randn_like(v) for k, v in state.items()}
        load.append(worker.load_weights(cycle + 1, weights))
        rows = [prompts.row(cycle * per_batch + i) for i in range(per_batch)]
        started = time.perf_counter()
        tokens = worker.generate(rows, cycle * per_batch)[1].completion_tokens
        gen.append(time.perf_counter() - started)
    print(json.dumps({"gen": gen, "load": load, "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    on_job = sub.add_parser("job")
    on_job.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    on_job.add_argument("--out", type=Path, default=REPO / "runs" / "cpu-matmul")
    on_generation = sub.add_parser("generation")
    on_generation.add_argument("--sizes", nargs="+", default=["default", "10M", "10M-long"])
    on_generation.add_argument("--cycles", type=int, default=6)
    on_one = sub.add_parser("one")  # internal: one worker, one setting
    on_one.add_argument("setting", choices=SETTINGS)
    on_one.add_argument("size")
    on_one.add_argument("cycles", type=int)
    args = parser.parse_args()
    if args.command == "job":
        args.out.mkdir(parents=True, exist_ok=True)
        job(args.seeds, args.out)
    elif args.command == "generation":
        generation(args.sizes, args.cycles)
    else:
        one(args.setting, args.size, args.cycles)


if __name__ == "__main__":
    main()
