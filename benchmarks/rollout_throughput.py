"""Rollout tokens/s of a RolloutWorker against plain vllm.LLM.generate, side by side.

Same model (the embedded tiny model), same prompts, same sampling parameters
(temperature 1, one logprob per sampled token, a seed per request), in one run:

  plain      vllm.LLM.generate in this process
  worker     RolloutWorker.generate in this process (builds Episodes on top); a
             prompt's samples are one vLLM request of n
  per-sample the same worker with one request a sample, as it samples when weights
             may load while requests run (rollout.in_flight_updates)
  actor      RolloutWorker.generate in a Ray actor, timed from the driver, which
             waits for the small stats record only (episodes stay in the object store)

The four are interleaved round by round so that machine noise hits each alike; the
script prints the median tokens/s of each and the ratios to plain. Goal: >= 0.9.

    python benchmarks/rollout_throughput.py [--rounds 7] [--prompts 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.config import Config
from rlray.rollout.worker import vllm_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per call (x4 samples)")
    args = parser.parse_args()
    config = Config()
    config.rollout.prompts_per_batch = args.prompts
    os.environ.update(vllm_env(config.rollout))

    import ray
    from vllm import SamplingParams

    from rlray.cluster.roles import RolloutActor
    from rlray.data.models import resolve_model_path
    from rlray.data.prompts import train_prompts
    from rlray.rollout.sampling import sampling_seed
    from rlray.rollout.worker import RolloutWorker

    model_path = resolve_model_path(config.model.path)
    rows = [train_prompts(config.data, 0).row(i) for i in range(args.prompts)]
    samples = config.rollout.samples_per_prompt
    worker = RolloutWorker("bench", model_path, config.model, config.rollout, "bench", seed=0)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = (
        ray.remote(RolloutActor)
        .options(num_cpus=1, runtime_env={"env_vars": vllm_env(config.rollout)})
        .remote("bench-actor", model_path, config.model, config.rollout, "bench", 0)
    )
    ray.get(actor.__ray_ready__.remote(), timeout=600)

    prompts = [r.prompt for r in rows for _ in range(samples)]
    params = [
        SamplingParams(
            max_tokens=config.rollout.max_new_tokens,
            temperature=config.rollout.temperature,
            logprobs=0,
            seed=sampling_seed(0, i, s),
        )
        for i in range(len(rows))
        for s in range(samples)
    ]

    def plain() -> int:
        outputs = worker.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def in_process() -> int:
        return worker.generate(rows, 0)[1].completion_tokens

    one_each = dataclasses.replace(config.rollout, in_flight_updates=True)

    def per_sample() -> int:
        grouped, worker.rollout = worker.rollout, one_each
        try:
            return worker.generate(rows, 0)[1].completion_tokens
        finally:
            worker.rollout = grouped

    def in_actor() -> int:
        _, stats = actor.generate.options(num_returns=2).remote(rows, 0)
        return ray.get(stats, timeout=600).completion_tokens

    runners = {"plain": plain, "worker": in_process, "per-sample": per_sample, "actor": in_actor}
    for run in runners.values():  # warm-up: first calls pay one-time costs
        run()
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            started = time.perf_counter()
            tokens = run()
            rates[name].append(tokens / (time.perf_counter() - started))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(
        f"{args.prompts} prompts x {samples} samples, max {config.rollout.max_new_tokens} "
        f"new tokens, {args.rounds} rounds, median tokens/s:"
    )
    for name, value in medians.items():
        print(f"  {name:<10} {value:9.0f} tokens/s   ratio to plain {value / medians['plain']:.3f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
