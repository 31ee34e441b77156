"""rlray's training loop at cluster scale, with simulated engines and a simulated learner
(rollout.backend and learner.backend simulated) on a many-node Ray made on this machine
(`ray.cluster_utils.Cluster`: every node a raylet with an object store of its own).

Each run is `jobs/ppo.py` itself, joined to the cluster: the driver, the buffer and
store actor, the reward workers, the weight publication through the object store and
the parity check after every sync are the real code; only the engines and the learner
are the simulator, taking the time the profile models (a 7B model on H100s by
default; rlray/simulator/profiles/). For each number of nodes and of simulated workers,
one batch from every worker a step, it prints per step after the first two:

  - the step's wall time against the modelled one (a batch's generation and a weight
    load on an engine, or the learner's step where longer): the difference is the
    control plane's overhead, and its share of the step;
  - the driver's CPU seconds (the job process's), and the whole machine's: the engines
    and the learner sleep through their modelled time, so what the machine's cores do is
    the control plane's work (Ray's raylets and object stores, the actors, the driver)
    and the simulator's bookkeeping; where they are near full, this machine bounds the
    overhead;
  - the weight sync: seconds from the publish until every engine holds the new weights
    (an engine loads after the batch it is generating), the slowest engine's load less
    the modelled load time, and how long the step waited for the sync;
  - episodes/s and bytes/s stored;

and how each grows with the number of workers.

    python benchmarks/simulated_loop.py --quick
    python benchmarks/simulated_loop.py --nodes 4 16 --workers 8 32 64
    python benchmarks/simulated_loop.py --nodes 4 --workers 64 --prompts 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
from control_plane import growth
from ray.cluster_utils import Cluster

from rlray.simulator.profile import load_profile

REPO = Path(__file__).resolve().parent.parent
ENGINE_NODE = "engine_node"
"""The custom resource of the nodes that hold simulated engines (not the head)."""
HEAD_NODE = "head_node"
"""The head's custom resource: the learner stays there, beside the driver and the store
(a fault that took it would resume the run from its checkpoint: a test of its own)."""
JOB_TIMEOUT_S = 1800.0
"""The longest one run may take: nothing waits forever."""
SKIPPED_STEPS = 2
"""Steps left out of the figures: start-up, and the first sync's (the last step is left
out too: it holds the final evaluation)."""


@dataclass
class Shape:
    """What one simulated run makes: a batch per worker per step."""

    workers: int
    steps: int
    prompts: int = 4
    samples: int = 4
    completion_tokens: int = 1024
    time_scale: float = 1.0
    weight_mb: int = 64
    profile: str = ""

    @property
    def batch(self) -> int:
        return self.prompts * self.samples

    def job_args(self, run_dir: Path) -> list[str]:
        return [
            "--rollout.backend", "simulated",
            "--learner.backend", "simulated",
            "--simulator.profile", self.profile,
            "--simulator.time_scale", str(self.time_scale),
            "--simulator.weight_bytes", str(self.weight_mb * 2**20),
            "--rollout.num_workers", str(self.workers),
            "--rollout.cpus_per_worker", "0.01",
            "--rollout.resources", json.dumps({ENGINE_NODE: 0.01}),
            "--rollout.prompts_per_batch", str(self.prompts),
            "--rollout.samples_per_prompt", str(self.samples),
            "--rollout.max_new_tokens", str(self.completion_tokens),
            "--rollout.min_new_tokens", str(self.completion_tokens),
            "--reward.num_workers", "2",
            "--reward.cpus_per_worker", "0.1",
            "--learner.cpus", "0.1",
            "--learner.resources", json.dumps({HEAD_NODE: 0.01}),
            "--learner.episodes_per_step", str(self.workers * self.batch),
            "--buffer.capacity_episodes", str(4 * self.workers * self.batch),
            "--learner.steps", str(self.steps),
            "--learner.eval_every", str(10 * self.steps),
            "--learner.checkpoint_every", str(10 * self.steps),
            "--data.eval_size", "8",
            "--ray.actor_start_timeout_s", "900",
            "--run-dir", str(run_dir),
        ]  # fmt: skip

    def modelled_step_s(self) -> float:
        """A step of a perfect control plane, scaled: an engine's batch and its weight
        load, or the learner's step over every batch where that is longer."""
        profile = load_profile(self.profile)
        tokens = [self.completion_tokens] * self.batch
        batch = profile.generate_seconds(self.batch * profile.prompt_tokens, tokens)
        step_tokens = self.workers * self.batch * (profile.prompt_tokens + self.completion_tokens)
        train = profile.train_seconds(step_tokens, self.workers)
        return max(batch + profile.load_seconds(), train) * self.time_scale


# ---------------------------------------------------------------- the cluster and a run


def start_cluster(nodes: int, store_mb: int) -> Cluster:
    """Starts a head (driver's actors: learner, store and buffer, reward workers) and
    `nodes` engine nodes, each with an object store of `store_mb`. Without token
    authentication, for it and for the jobs that join it (whose environment this is): a
    job that sent a token to a cluster that does not check them refuses its calls."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {HEAD_NODE: 1},
            "include_dashboard": False,
            "object_store_memory": store_mb * 2**20,
        },
    )
    for _ in range(nodes):
        cluster.add_node(
            num_cpus=2, resources={ENGINE_NODE: 100}, object_store_memory=store_mb * 2**20
        )
    cluster.wait_for_nodes()
    return cluster


@dataclass
class StepRecord:
    """A step's metrics line, with the job process's CPU seconds when it appeared."""

    metrics: dict[str, Any]
    driver_cpu_s: float
    seen_at: float
    """time.monotonic() when it was read (within 0.2 s of its writing)."""
    machine_cpu_s: float = 0.0
    """The machine's busy CPU seconds, all its cores, every process (machine_busy_s)."""


@dataclass
class RunResult:
    steps: list[StepRecord] = field(default_factory=list)
    exit_code: int | None = None
    seconds: float = 0.0
    output: str = ""


def run_job(
    address: str,
    argv: list[str],
    run_dir: Path,
    on_poll: Callable[[list[StepRecord]], None] | None = None,
    timeout_s: float = JOB_TIMEOUT_S,
) -> RunResult:
    """Runs jobs/ppo.py joined to the cluster at `address`, reading its metrics.jsonl as
    it grows and the job process's CPU time at each step; `on_poll` is called with the
    steps so far at every look (5 a second), in this thread."""
    log = run_dir.with_suffix(".log")
    env = {**os.environ, "RAY_ADDRESS": address}
    command = [sys.executable, str(REPO / "jobs" / "ppo.py"), *argv]
    started = time.monotonic()
    result = RunResult()
    with log.open("w") as out:
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        process = psutil.Process(job.pid)
        seen = 0
        while job.poll() is None:
            if time.monotonic() - started > timeout_s:
                job.kill()
                raise RuntimeError(f"the run did not end within {timeout_s:.0f} s: {log}")
            lines = read_steps(run_dir / "metrics.jsonl")
            for metrics in lines[seen:]:
                cpu = process.cpu_times()
                record = StepRecord(
                    metrics, cpu.user + cpu.system, time.monotonic(), machine_busy_s()
                )
                result.steps.append(record)
            seen = len(lines)
            if on_poll is not None:
                on_poll(result.steps)
            time.sleep(0.2)
    result.exit_code, result.seconds = job.returncode, time.monotonic() - started
    result.output = log.read_text()
    return result


def machine_busy_s() -> float:
    """CPU seconds the machine's cores have been busy (not idle, not waiting on disk)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The training steps' lines of a metrics.jsonl so far (whole lines only)."""
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]  # the last may be half written
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if "elapsed_seconds" in r and "episodes" in r]


# ---------------------------------------------------------------- figures


def figures(result: RunResult, shape: Shape) -> dict[str, float]:
    """The per-step figures of a run, over its steps after SKIPPED_STEPS and before the
    last, whose time holds the run's final evaluation (modelled generation)."""
    steps = result.steps[SKIPPED_STEPS:-1]
    if len(steps) < 2:
        raise RuntimeError(f"only {len(result.steps)} steps were logged:\n{result.output[-2000:]}")
    count = len(steps) - 1
    first, last = steps[0], steps[-1]
    wall = (last.metrics["elapsed_seconds"] - first.metrics["elapsed_seconds"]) / count
    cpu = (last.driver_cpu_s - first.driver_cpu_s) / count
    machine_cpu = (last.machine_cpu_s - first.machine_cpu_s) / count
    modelled = shape.modelled_step_s()
    load = load_profile(shape.profile).load_seconds() * shape.time_scale
    syncs = [s.metrics.get("weight_sync_seconds") for s in steps[1:]]
    syncs = [s for s in syncs if s is not None]
    loads = [s.metrics.get("weight_load_seconds") for s in steps[1:]]
    loads = [s for s in loads if s is not None]
    waits = [s.metrics.get("phase_seconds", {}).get("weight_sync", 0.0) for s in steps[1:]]
    parity = [s.metrics.get("logprob_parity_error") for s in steps]
    episodes = shape.workers * shape.batch
    episode_bytes = 8 * (load_profile(shape.profile).prompt_tokens + 2 * shape.completion_tokens)
    return {
        "step_s": wall,
        "modelled_step_s": modelled,
        "overhead_s": wall - modelled,
        "overhead_share": (wall - modelled) / wall,
        "driver_cpu_s": cpu,
        "driver_cpu_ms_per_batch": 1000 * cpu / shape.workers,
        "machine_cpu_s": machine_cpu,
        "machine_busy_share": machine_cpu / (wall * (psutil.cpu_count() or 1)),
        "weight_sync_s": statistics.median(syncs) if syncs else math.nan,
        "weight_load_s": statistics.median(loads) - load if loads else math.nan,
        "sync_wait_s": statistics.median(waits),
        "episodes_per_s": episodes / wall,
        "stored_mb_per_s": episodes * episode_bytes / wall / 2**20,
        "parity_max": max((p for p in parity if p is not None), default=math.nan),
    }


FIGURES = [
    ("step_s", "seconds a step", "{:.2f}"),
    ("modelled_step_s", "modelled seconds a step", "{:.2f}"),
    ("overhead_s", "control overhead (s a step)", "{:.2f}"),
    ("overhead_share", "control overhead (share of the step)", "{:.1%}"),
    ("driver_cpu_s", "driver CPU (s a step)", "{:.3f}"),
    ("driver_cpu_ms_per_batch", "driver CPU (ms a batch)", "{:.2f}"),
    ("machine_cpu_s", "machine CPU, all processes (s a step)", "{:.2f}"),
    ("machine_busy_share", "machine CPU (share of its cores)", "{:.0%}"),
    ("weight_sync_s", "weight sync: publish to all loaded (s)", "{:.2f}"),
    ("weight_load_s", "slowest load less modelled (s)", "{:.2f}"),
    ("sync_wait_s", "the step's wait for the sync (s)", "{:.2f}"),
    ("episodes_per_s", "episodes/s", "{:.1f}"),
    ("stored_mb_per_s", "token bytes stored (MiB/s)", "{:.2f}"),
    ("parity_max", "largest parity gap after a sync", "{:.3g}"),
]


UNFITTED = ("overhead_share", "machine_busy_share", "parity_max")
"""Figures printed without a growth fit: shares, and the parity gap (0 unless broken)."""


def print_table(nodes: int, results: dict[int, dict[str, float]]) -> None:
    counts = sorted(results)
    print(f"\nresults, {nodes} engine nodes (N = simulated workers)")
    header = f"{'figure':<40}" + "".join(f"{'N=' + str(n):>10}" for n in counts) + "  growth"
    print(header)
    print("-" * len(header))
    for key, label, fmt in FIGURES:
        values = [results[n][key] for n in counts]
        cells = "".join(f"{fmt.format(v):>10}" for v in values)
        trend = growth(counts, values) if key not in UNFITTED else ""
        print(f"{label:<40}{cells}  {trend}")


# ---------------------------------------------------------------- main


def free_gib() -> float:
    return psutil.virtual_memory().available / 2**30


def measure(nodes: int, args: argparse.Namespace, scratch: Path) -> dict[int, dict]:
    """Starts a cluster of `nodes` engine nodes, runs the loop at each worker count."""
    print(f"\nstarting a cluster: a head and {nodes} engine nodes", flush=True)
    cluster = start_cluster(nodes, store_mb=max(3 * args.weight_mb, 300))
    results: dict[int, dict] = {}
    try:
        for workers in sorted(args.workers):
            if free_gib() < args.min_free_gib:
                print(f"  skipping {workers} workers and more: {free_gib():.1f} GiB free")
                break
            shape = Shape(
                workers,
                args.steps,
                prompts=args.prompts,
                completion_tokens=args.completion_tokens,
                time_scale=args.time_scale,
                weight_mb=args.weight_mb,
                profile=args.profile,
            )
            run_dir = scratch / f"nodes{nodes}-workers{workers}"
            print(
                f"{workers} workers on {nodes} nodes: {args.steps} steps of about "
                f"{shape.modelled_step_s():.1f} s modelled, plus start-up",
                flush=True,
            )
            result = run_job(cluster.address, shape.job_args(run_dir), run_dir)
            if result.exit_code != 0:
                raise RuntimeError(f"the run failed ({result.exit_code}):\n{result.output[-3000:]}")
            results[workers] = figures(result, shape)
            print(f"  {result.seconds:.0f} s, {results[workers]['step_s']:.2f} s a step")
    finally:
        cluster.shutdown()
    print_table(nodes, results)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small version")
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=4, help="a batch's (4 samples each)")
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--weight-mb", type=int, default=64, help="published weights (MiB)")
    parser.add_argument("--profile", default="", help="simulator profile (default: 7B, H100)")
    parser.add_argument("--min-free-gib", type=float, default=3.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.workers, args.steps = [2], [4, 8], 4
        args.completion_tokens, args.time_scale, args.weight_mb = 128, 0.25, 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlray-simulated-loop-") as scratch:
        for nodes in args.nodes:
            results[nodes] = measure(nodes, args, Path(scratch))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "results": results}))


if __name__ == "__main__":
    main()
