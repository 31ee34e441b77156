"""A bounded soak with faults: rlray's training loop with simulated engines and learner
(benchmarks/simulated_loop.py's) on a many-node Ray made on this machine, while, every
30-60 s at random, one of these is killed with SIGKILL: a rollout worker, a reward
worker, the buffer and store (one process), a store shard (with --store-shards 2 or
more), or a whole engine node (its raylet and every actor on it, then a new node
joins). Afterwards it checks, and prints:

  - every episode stored exactly once: each (prompt, sample) of every prompt handed out
    (the last checkpoint's prompt cursor) once in the store, no id twice;
  - nothing hung: the run ended by itself, every step within ray.call_timeout_s;
  - every parity check after a sync at 0: every engine held the weights published;
  - the learner trained only on episodes within buffer.max_staleness, by the metrics
    and by the store (episodes trained in one step share its trained_at);
  - throughput: the steps' median time before any fault, and after each fault the
    seconds until a step took no more than RECOVERED x that median again.

    python benchmarks/chaos_soak.py --quick           # each target once, in turn
    python benchmarks/chaos_soak.py --minutes 20      # 32 workers on 4 nodes
    python benchmarks/chaos_soak.py --minutes 20 --weight-relay --store-shards 2
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
from simulated_loop import ENGINE_NODE, RunResult, Shape, run_job, start_cluster

from rlray.core.checkpoints import latest_checkpoint, resume_point
from rlray.episodes.reader import read

STORE_MB = 300
"""Each node's object store."""
RECOVERED = 1.5
"""A step is back to speed when it takes at most this times the median before faults."""
TARGETS = ("rollout worker", "reward worker", "buffer and store", "engine node")
PROCESS_TITLES = {
    "rollout worker": "ray::SimulatedRolloutActor",
    "reward worker": "ray::RewardActor",
    "buffer and store": "ray::EpisodesActor",
    "store shard": "ray::StoreActor",  # store-1 and up (store.shards)
}


@dataclass
class Fault:
    at: float
    """time.monotonic() when it was made."""
    target: str
    detail: str


@dataclass
class Chaos:
    """Kills one of TARGETS every `low`-`high` seconds once the run has made a step,
    from the thread that polls the run (Ray adds a node from the main thread only)."""

    cluster: object
    low: float
    high: float
    seed: int
    in_turn: bool = False
    """Each target in turn (TARGETS' order) instead of one chosen at random."""
    targets: tuple[str, ...] = TARGETS
    faults: list[Fault] = field(default_factory=list)
    next_at: float | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def poll(self, steps: list) -> None:
        """Makes the next fault if its time has come (the first step starts the clock)."""
        now = time.monotonic()
        if not steps:
            return
        if self.next_at is None:
            self.next_at = now + self.rng.uniform(self.low, self.high)
        if now < self.next_at:
            return
        turn = len(self.faults)
        targets = self.targets
        target = targets[turn % len(targets)] if self.in_turn else self.rng.choice(targets)
        rng = self.rng
        detail = self.node(rng) if target == "engine node" else self.process(target, rng)
        if detail:
            self.faults.append(Fault(now, target, detail))
            print(f"  fault: {target} ({detail})", flush=True)
        self.next_at = time.monotonic() + self.rng.uniform(self.low, self.high)

    def process(self, target: str, rng: random.Random) -> str:
        """SIGKILLs one process of the target's kind, chosen at random."""
        title = PROCESS_TITLES[target]
        found = [p for p in psutil.process_iter(["cmdline"]) if _titled(p, title)]
        if not found:
            return ""
        victim = rng.choice(found)
        os.kill(victim.pid, signal.SIGKILL)
        return f"pid {victim.pid}"

    def node(self, rng: random.Random) -> str:
        """Removes an engine node at once, as a machine that fails, and adds a new one."""
        nodes = [n for n in self.cluster.worker_nodes if n is not self.cluster.head_node]
        victim = rng.choice(nodes)
        self.cluster.remove_node(victim, allow_graceful=False)
        self.cluster.add_node(
            num_cpus=2,
            resources={ENGINE_NODE: 100},
            object_store_memory=STORE_MB * 2**20,
        )
        return f"node {victim.node_id[:8]}, replaced"


def _titled(process: psutil.Process, title: str) -> bool:
    cmdline = process.info.get("cmdline") or []
    return bool(cmdline) and cmdline[0].split(".")[0] == title


# ---------------------------------------------------------------- checks


def check_store(run_dir: Path, samples: int, max_staleness: int) -> dict[str, int]:
    """Every (prompt, sample) handed out stored once; trained episodes within the bound.
    Returns the counts; raises AssertionError naming the first thing wrong."""
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None, "the run left no checkpoint"
    _, handed_out = resume_point(str(checkpoint))
    rows = read(run_dir / "episodes").to_pylist()
    ids = Counter(r["episode_id"] for r in rows)
    twice = [i for i, n in ids.items() if n > 1]
    assert not twice, f"{len(twice)} episode ids stored twice, e.g. {twice[0]}"
    stored = Counter((r["prompt_index"], r["sample_index"]) for r in rows)
    expected = {(p, s) for p in range(handed_out) for s in range(samples)}
    missing, doubled = expected - set(stored), [k for k, n in stored.items() if n > 1]
    extra = set(stored) - expected
    assert not missing, f"{len(missing)} episodes handed out and never stored, e.g. {min(missing)}"
    assert not doubled, f"{len(doubled)} episodes stored twice, e.g. {min(doubled)}"
    assert not extra, f"{len(extra)} episodes beyond the prompts handed out, e.g. {min(extra)}"
    steps: dict[float, list[int]] = {}
    for row in rows:
        if row["trained_at"] is not None:
            steps.setdefault(row["trained_at"], []).append(row["policy_version"])
    stale = [
        step - 1 - min(versions)
        for step, (_, versions) in enumerate(sorted(steps.items()), start=1)
    ]
    assert max(stale, default=0) <= max_staleness, f"a step trained episodes {max(stale)} behind"
    return {
        "prompts handed out": handed_out,
        "episodes stored": len(rows),
        "episodes trained": sum(len(v) for v in steps.values()),
        "steps in the store": len(steps),
        "most versions behind": max(stale, default=0),
    }


def recovery(result: RunResult, faults: list[Fault]) -> dict[str, float]:
    """The steps' median seconds before the first fault, and the slowest recovery: from a
    fault to the end of the first step after it that took at most RECOVERED x that."""
    ends = [s.seen_at for s in result.steps]
    durations = [b - a for a, b in itertools.pairwise(ends)]
    first = faults[0].at if faults else float("inf")
    before = [d for d, end in zip(durations, ends[1:], strict=True) if end < first][2:]
    if not before:
        before = durations[2:] or durations
    median = statistics.median(before)
    worst = 0.0
    for fault in faults:
        back = next(
            (end for d, end in zip(durations, ends[1:], strict=True)
             if end > fault.at and d <= RECOVERED * median),
            None,
        )  # fmt: skip
        worst = max(worst, (back - fault.at) if back is not None else float("inf"))
    return {"median_step_s": median, "slowest_recovery_s": worst}


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short version (minutes)")
    parser.add_argument("--minutes", type=float, default=20.0, help="how long faults come")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--every", type=float, nargs=2, default=[30.0, 60.0], help="seconds")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="of the modelled times (simulator)"
    )
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-relay", action="store_true", help="rollout.weight_relay true")
    parser.add_argument("--store-shards", type=int, default=1, help="store.shards")
    args = parser.parse_args(argv)
    if args.quick:  # each target once: about 20 s of faults a target
        args.minutes = 0.4 * len(targets_of(args))
        args.nodes, args.workers, args.every = 2, 8, [15.0, 20.0]
        args.time_scale = 0.25  # short steps: each fault's recovery within the run
    return args


def targets_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The kinds of fault a soak makes: a store shard's too where it has more than one."""
    return TARGETS + (("store shard",) if args.store_shards > 1 else ())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = Shape(
        args.workers,
        steps=10_000,  # ended by the run's time limit below
        completion_tokens=args.completion_tokens,
        time_scale=args.time_scale,
        weight_mb=16,
    )
    modelled = shape.modelled_step_s()
    steps = max(4, int(args.minutes * 60 / modelled))
    shape.steps = steps
    print(
        f"{args.workers} simulated workers on {args.nodes} nodes, {steps} steps of about "
        f"{modelled:.1f} s modelled ({args.minutes:g} min); a fault every "
        f"{args.every[0]:g}-{args.every[1]:g} s",
        flush=True,
    )
    cluster = start_cluster(args.nodes, store_mb=STORE_MB)
    targets = targets_of(args)
    chaos = Chaos(cluster, *args.every, seed=args.seed, in_turn=args.quick, targets=targets)
    with tempfile.TemporaryDirectory(prefix="rlray-chaos-") as scratch:
        run_dir = Path(scratch) / "run"
        job_args = shape.job_args(run_dir)
        job_args += ["--ray.max_actor_restarts", "1000", "--ray.call_timeout_s", "120"]
        job_args += ["--buffer.max_staleness", str(args.max_staleness)]
        job_args += ["--learner.checkpoint_every", "5"]
        job_args += ["--rollout.weight_relay", str(args.weight_relay).lower()]
        job_args += ["--store.shards", str(args.store_shards)]
        timeout = args.minutes * 60 * 3 + 600
        result = run_job(cluster.address, job_args, run_dir, chaos.poll, timeout)
        try:
            print(f"\n{len(chaos.faults)} faults: {Counter(f.target for f in chaos.faults)}")
            assert result.exit_code == 0, f"the run failed:\n{result.output[-3000:]}"
            counts = check_store(run_dir, shape.samples, args.max_staleness)
            parity = [s.metrics.get("logprob_parity_error") for s in result.steps]
            assert all(p in (None, 0.0) for p in parity), f"a parity gap after a sync: {parity}"
            behind = max(s.metrics.get("staleness_max", 0) for s in result.steps)
            assert behind <= args.max_staleness, f"the learner trained {behind} versions behind"
            timing = recovery(result, chaos.faults)
        finally:
            cluster.shutdown()
    for name, value in counts.items():
        print(f"{name}: {value}")
    print(f"steps: {len(result.steps)} of {steps}, in {result.seconds:.0f} s, every one ended")
    print(f"median step before any fault: {timing['median_step_s']:.2f} s")
    print(
        f"slowest recovery (a step within {RECOVERED}x of it): {timing['slowest_recovery_s']:.1f} s"
    )
    print("every episode stored exactly once; nothing hung; every parity check 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
