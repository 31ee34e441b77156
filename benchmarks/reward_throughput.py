"""Reward scoring throughput with 1 and 2 reward workers, and the default job's reward wait.

In one run:
  code       the sandboxed code-tests reward (a subprocess per episode, 3 tests each)
  embedding  cosine similarity of MiniLM embeddings against a reference
each scored by 1 and then 2 RewardWorker actors (batches handed out in turn, as the
driver does), printed as episodes/s and the 2-worker speed-up. Then a short default
job (`jobs/ppo.py`, all defaults but the step count) and the share of its wall time
the driver spent waiting with every batch generated and only scoring pending.

    python benchmarks/reward_throughput.py [--batches 8] [--batch-size 32] [--job-steps 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray

from rlray.config import RewardSpec
from rlray.core.episode import Episode
from rlray.rewards.worker import RewardWorker

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = [
    "```python\ndef add(a, b):\n    return a + b\n```",
    "```python\ndef add(a, b):\n    return a - b\n```",
]
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
SENTENCES = [
    ("The cat sat on the mat.", "A cat was sitting on the mat."),
    ("Stock prices fell sharply today.", "The weather is sunny and warm."),
    ("Das Wetter ist heute schön.", "The weather is nice today."),
]


def episode(index: int, completion: str, columns: dict) -> Episode:
    return Episode(
        run_id="bench",
        episode_id=f"bench-{index}",
        prompt_index=index,
        sample_index=0,
        prompt="Write add(a, b).",
        completion=completion,
        prompt_token_ids=[1],
        completion_token_ids=[1],
        rollout_logprobs=[0.0],
        finish_reason="stop",
        policy_version=0,
        rollout_worker="bench",
        columns=columns,
    )


def code_batch(size: int) -> list[Episode]:
    return [episode(i, SOLUTIONS[i % 2], {"tests": TESTS}) for i in range(size)]


def embedding_batch(size: int) -> list[Episode]:
    pairs = [SENTENCES[i % len(SENTENCES)] for i in range(size)]
    return [episode(i, text, {"reference": ref}) for i, (text, ref) in enumerate(pairs)]


def episodes_per_second(
    spec: RewardSpec, make_batch, workers: int, batches: int, size: int
) -> float:
    """Returns episodes/s of `workers` reward actors scoring `batches` batches in turn."""
    actors = [
        ray.remote(RewardWorker)
        .options(num_cpus=1)
        .remote(f"reward-{i}", [spec], "skip_component", size)
        for i in range(workers)
    ]
    try:
        ray.get([a.score.remote(make_batch(size)) for a in actors], timeout=600)  # warm-up
        payloads = [ray.put(make_batch(size)) for _ in range(batches)]
        started = time.perf_counter()
        results = [
            actors[i % workers].score.options(num_returns=2).remote(p)
            for i, p in enumerate(payloads)
        ]
        stats = ray.get([stats for _, stats in results], timeout=1200)
        seconds = time.perf_counter() - started
        failures = sum(sum(s.failures.values()) for s in stats)
        assert failures == 0, f"{spec.name}: {failures} scoring failures"
        return batches * size / seconds
    finally:
        for actor in actors:
            ray.kill(actor)


def reward_wait_share(steps: int) -> tuple[float, float, float]:
    """Runs the default job for `steps` steps; returns (wait seconds, reward seconds, wall)."""
    with tempfile.TemporaryDirectory(prefix="rlray-bench-") as run_dir:
        subprocess.run(
            [
                sys.executable,
                str(REPO / "jobs" / "ppo.py"),
                "--learner.steps",
                str(steps),
                "--run-dir",
                run_dir,
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
            timeout=1800,
        )
        records = [
            json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()
        ]
        summary = json.loads(Path(run_dir, "summary.json").read_text())
    wait = sum(r.get("reward_wait_seconds", 0.0) for r in records)
    scoring = sum(r.get("reward_seconds", 0.0) for r in records)
    return wait, scoring, summary["wall_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--job-steps", type=int, default=30)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rewards = {
        "code": (RewardSpec(name="code_tests"), code_batch),
        "embedding": (RewardSpec(name="embedding_similarity"), embedding_batch),
    }
    print(f"{args.batches} batches of {args.batch_size} episodes:")
    for label, (spec, make_batch) in rewards.items():
        rates = [
            episodes_per_second(spec, make_batch, w, args.batches, args.batch_size) for w in (1, 2)
        ]
        print(
            f"  {label:<9} 1 worker {rates[0]:8.1f} episodes/s   2 workers {rates[1]:8.1f} "
            f"episodes/s   speed-up {rates[1] / rates[0]:.2f}",
            flush=True,
        )
    ray.shutdown()
    wait, scoring, wall = reward_wait_share(args.job_steps)
    print(
        f"default job, {args.job_steps} steps: waited on rewards {wait:.2f} s of {wall:.1f} s "
        f"wall ({100 * wait / wall:.2f}%); time inside reward functions {scoring:.2f} s"
    )


if __name__ == "__main__":
    main()
