"""The control plane at cluster scale, on a many-node Ray made on this machine
(`ray.cluster_utils.Cluster`: every node a raylet with an object store of its own).

No engine and no model: stand-in workers (`SimWorker`) make synthetic episodes at once,
and everything they talk to is rlray's own code: the buffer actor (BufferActor), the
store actor (StoreActor writing Parquet), the learner's weight packing (pack_weights),
and the driver's batch bookkeeping (Rollouts, Recovery, StoreWrites). For each number
of nodes and of workers it measures:

  a. the buffer: batches/s through it, each batch a reserve, an add of its reference and
     a share of a take, from W producers at once, and its CPU per batch;
  b. the store: episodes/s and bytes/s storing realistic episodes (prompt and completion
     tokens with logprobs, text) made on the workers' nodes, and its CPU per episode;
     every stored row counted and checked against the ids sent; with --store-shards,
     the same episodes through several store actors (store.shards) beside one;
  c. a weight broadcast: seconds until every one of W engines holds a weights object
     the learner published (packed as rlray's learner packs them), pulled to each
     engine's node through the object store;
  d. the driver: CPU and wall seconds per step of W batches (a batch per worker, each
     reserved, generated, scored, added, taken, trained on and stored) with no modelled
     work, so the step is all control overhead;
  e. the driver's scans of its batches in flight (Rollouts' own methods), in this
     process, at worker counts no cluster here can hold.

Each figure is printed by worker count with how it grows (the slope of log figure
against log workers: constant, linear or worse). The simulated engine of issue 65 is
not this script: here the workers do nothing but answer. docs/scale.md says what the
figures mean at 1,024 GPUs.

    python benchmarks/control_plane.py --quick
    python benchmarks/control_plane.py --nodes 4 16 --workers 8 32 64 --sizes-mb 64 256
    python benchmarks/control_plane.py --nodes 4 --workers 64 --store-shards 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import pyarrow.dataset as ds
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlray.cluster.roles import STORE_GROUPS, BufferActor, StoreActor
from rlray.config import StoreConfig
from rlray.core.episode import Episode, to_table
from rlray.core.prompt import PromptRow
from rlray.core.stats import GenerateStats, ScoreStats
from rlray.driver.recovery import Recovery
from rlray.driver.rollouts import InFlight, Rollouts
from rlray.driver.store_writes import StoreWrites
from rlray.driver.weight_relay import relay_waves
from rlray.episodes.buffer import BufferedBatch
from rlray.observe.timing import PhaseClock

TIMEOUT_S = 300.0
"""Every wait of this script: nothing waits forever, a stuck actor fails the run."""
RUN_ID = "bench"
SAMPLES = 4
"""Samples a prompt in the driver's steps (rlray's default rollout.samples_per_prompt)."""
VOCAB = 151_000
WORDS = np.array(["the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with"])
GIB = 2**30


# ---------------------------------------------------------------- synthetic episodes


def synthetic_episodes(
    worker: str,
    first_index: int,
    prompts: int,
    prompt_tokens: int,
    completion_tokens: int,
    samples: int = 1,
) -> list[Episode]:
    """Returns `samples` scored episodes of each of `prompts` prompts from `first_index`:
    random tokens, logprobs and words (a word a token), ids unique by prompt index and
    sample; deterministic from the index."""
    rng = np.random.default_rng(first_index)
    now = time.time()
    return [
        Episode(
            run_id=RUN_ID,
            episode_id=f"{RUN_ID}-{first_index + i // samples}-{i % samples}",
            prompt_index=first_index + i // samples,
            sample_index=i % samples,
            prompt=" ".join(rng.choice(WORDS, prompt_tokens)),
            completion=" ".join(rng.choice(WORDS, completion_tokens)),
            prompt_token_ids=rng.integers(0, VOCAB, prompt_tokens).tolist(),
            completion_token_ids=rng.integers(0, VOCAB, completion_tokens).tolist(),
            rollout_logprobs=(-rng.exponential(1.0, completion_tokens)).astype(np.float32).tolist(),
            finish_reason="length",
            policy_version=0,
            rollout_worker=worker,
            columns={"answer": str(i)},
            reward=1.0,
            reward_components={"correct": 1.0},
            generated_at=now,
            scored_at=now,
        )
        for i in range(prompts * samples)
    ]


# ---------------------------------------------------------------- actors


class SimWorker:
    """Stands in for a rollout worker (and a reward worker): no engine, answers at once.
    It produces into the buffer (a), makes the batches the store stores (b), holds
    published weights as an engine would (c), and generates and scores for the driver
    (d)."""

    def __init__(self, name: str, prompt_tokens: int, completion_tokens: int):
        self.name = name
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    def make_batch(self, first_index: int, count: int) -> list[Episode]:
        """Returns a batch of realistic size (returned into this node's object store)."""
        return synthetic_episodes(
            self.name, first_index, count, self.prompt_tokens, self.completion_tokens
        )

    def produce(self, buffer: Any, episodes: int, seconds: float, first_id: int) -> dict:
        """Reserves room, puts a batch into the object store and adds its reference to the
        buffer, over and over for `seconds`; returns counts and each round trip's seconds.
        The batch is small: the buffer's cost is per batch, whatever the batch holds."""
        payload = synthetic_episodes(self.name, first_id, 2, 16, 16)
        added = refused = 0
        round_trips = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.perf_counter()
            if not ray.get(buffer.reserve.remote(episodes), timeout=TIMEOUT_S):
                refused += 1
                time.sleep(0.005)  # as a driver waits for a learner step
                continue
            batch = BufferedBatch([ray.put(payload)], 0, episodes, first_id + added, added)
            ray.get(buffer.add.remote(batch, episodes), timeout=TIMEOUT_S)
            round_trips.append(time.perf_counter() - started)
            added += 1
        return {"added": added, "refused": refused, "round_trips": round_trips}

    def hold(self, published: list[Any]) -> str:
        """Returns this node's id once the published weights are in its object store (the
        pull that resolving load_published's argument makes)."""
        # Not deserialized here: that would import torch into every stand-in engine,
        # and a packed array is read in place (a view) anyway.
        ready, _ = ray.wait(published, num_returns=1, timeout=TIMEOUT_S, fetch_local=True)
        if not ready:
            raise TimeoutError(f"{self.name}: weights not here within {TIMEOUT_S:.0f} s")
        return ray.get_runtime_context().get_node_id()

    def generate(self, rows: list[PromptRow], first_prompt_index: int) -> tuple:
        """A RolloutWorker.generate that takes no time: SAMPLES small episodes a prompt."""
        episodes = synthetic_episodes(self.name, first_prompt_index, len(rows), 16, 16, SAMPLES)
        for episode in episodes:
            # Big enough a batch to go by reference through the object store, as a real
            # one does (Ray hands small objects back inline, through the driver).
            episode.prompt = "w " * 512
        tokens = sum(len(e.completion_token_ids) for e in episodes)
        return episodes, GenerateStats(self.name, 0, len(episodes), tokens, 0.0)

    def score(self, episodes: list[Episode], step: int = 0) -> tuple:
        """A RewardWorker.score that takes no time."""
        return episodes, ScoreStats(self.name, len(episodes), float(len(episodes)), 0.0)


class SimLearner:
    """Stands in for the learner: publishes weights of a given size, packed as rlray's
    learner packs them, and trains on a step's references by fetching them."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}
        self.size_bytes = 0

    def publish(self, version: int, size_bytes: int, tensors: int = 32) -> tuple[int, Any]:
        """Returns (version, PackedWeights) of `tensors` bfloat16 tensors, `size_bytes`
        in all: as LearnerActor.publish_weights, stored once in this node's object store."""
        # torch in this one actor only
        import torch

        from rlray.weights.packing import pack_weights

        if self.size_bytes != size_bytes:
            self.weights = {}  # freed before the next size is made
            numel = size_bytes // 2 // tensors
            self.weights = {
                f"model.layers.{i}.weight": torch.full((numel,), 0.5, dtype=torch.bfloat16)
                for i in range(tensors)
            }
            self.size_bytes = size_bytes
        return version, pack_weights(self.weights)

    def train_on(self, batch_refs: list[list[Any]], timeout_s: float) -> dict[str, float]:
        """Fetches the step's episodes, as the learner does, and returns a small record."""
        batches = ray.get([box[0] for box in batch_refs], timeout=timeout_s)
        return {"episodes": float(sum(len(batch) for batch in batches)), "loss": 0.0}


class Consumer:
    """Takes learner steps' worth of batches from the buffer, as fast as they come."""

    def take_for(self, buffer: Any, episodes: int, seconds: float) -> int:
        """Returns how many batches it took in `seconds`."""
        taken = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            result = ray.get(buffer.take.remote(episodes, 0), timeout=TIMEOUT_S)
            if result is None:
                time.sleep(0.002)
            else:
                taken += len(result.batches)
        return taken


class ProfiledBuffer(BufferActor):
    """rlray's buffer actor, with its process's CPU seconds on request."""

    def cpu_seconds(self) -> float:
        return time.process_time()


class ProfiledStore(StoreActor):
    """rlray's store actor, with its process's CPU seconds on request."""

    def cpu_seconds(self) -> float:
        return time.process_time()


REMOTE = {
    "worker": ray.remote(SimWorker),
    "learner": ray.remote(SimLearner),
    "consumer": ray.remote(Consumer),
    "buffer": ray.remote(BufferActor),
    "store": ray.remote(concurrency_groups=STORE_GROUPS)(StoreActor),
    "profiled_buffer": ray.remote(ProfiledBuffer),
    "profiled_store": ray.remote(concurrency_groups=STORE_GROUPS)(ProfiledStore),
}
"""The actor classes, made remote once."""


# ---------------------------------------------------------------- the cluster


@dataclass
class Bench:
    """The cluster and the actors every measurement shares."""

    cluster: Cluster
    head: Any  # scheduling strategy: the head node
    nodes: list[Any]  # scheduling strategies: one per worker node, in order
    learner: Any
    workers: list[Any]
    args: argparse.Namespace

    def on_head(self) -> dict[str, Any]:
        return {"num_cpus": 0.01, "scheduling_strategy": self.head}

    def grow(self, count: int) -> None:
        """Starts workers until there are `count`, round-robin over the nodes."""
        started = len(self.workers)
        for index in range(started, count):
            node = self.nodes[index % len(self.nodes)]
            args = (f"sim-{index}", self.args.prompt_tokens, self.args.completion_tokens)
            actor = REMOTE["worker"].options(num_cpus=0.01, scheduling_strategy=node)
            self.workers.append(actor.remote(*args))
        if count > started:
            print(f"  starting {count - started} workers ({count} over {len(self.nodes)} nodes)")
            wait_all([w.__ray_ready__.remote() for w in self.workers], "workers start")


def start_cluster(nodes: int, args: argparse.Namespace) -> Bench:
    """Starts a head (learner, buffer, store) and `nodes` worker nodes, each with an
    object store big enough for two copies of the largest weights."""
    largest = max(args.sizes_mb) * 2**20
    per_node = int(max(2.2 * largest, 200 * 2**20))
    print(f"starting a cluster: a head and {nodes} nodes, {per_node / 2**20:.0f} MiB stores")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": int(max(3 * largest, 400 * 2**20)),
        },
    )
    worker_nodes = [
        cluster.add_node(num_cpus=1, object_store_memory=per_node) for _ in range(nodes)
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    strategies = [NodeAffinitySchedulingStrategy(node.node_id, soft=False) for node in worker_nodes]
    head = NodeAffinitySchedulingStrategy(cluster.head_node.node_id, soft=False)
    learner = REMOTE["learner"].options(num_cpus=0.01, scheduling_strategy=head).remote()
    warm_up = learner.publish.remote(-1, 2**20)  # imports torch, as a real learner has
    ray.wait([warm_up], timeout=TIMEOUT_S, fetch_local=False)
    return Bench(cluster, head, strategies, learner, [], args)


def wait_all(refs: list[Any], what: str, progress: Callable[[int], str] | None = None) -> list:
    """Returns ray.get(refs), printing `progress(done)` every two seconds meanwhile."""
    deadline = time.monotonic() + TIMEOUT_S
    pending = list(refs)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {len(pending)} of {len(refs)} not done in {TIMEOUT_S} s")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=2.0)
        if pending and progress is not None:
            print(f"    {progress(len(refs) - len(pending))}", flush=True)
    return ray.get(refs, timeout=TIMEOUT_S)


def free_gib() -> float:
    """Returns the memory available on this machine (MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return math.inf


# ---------------------------------------------------------------- a. the buffer


def measure_buffer(bench: Bench, workers: int) -> dict[str, float]:
    """W producers reserve, put and add as fast as they can while a consumer takes steps
    of W batches; returns batches/s through the buffer and its CPU per batch. The buffer
    has room for all: what is measured is its calls, not producers waiting on a learner."""
    seconds, episodes = bench.args.buffer_seconds, bench.args.batch_episodes
    print(f"  a. buffer: {workers} producers add batches for {seconds:.0f} s, one taker")
    buffer = REMOTE["profiled_buffer"].options(**bench.on_head()).remote(RUN_ID, 10**12, 10**9)
    consumer = REMOTE["consumer"].options(**bench.on_head()).remote()
    try:
        cpu_before = ray.get(buffer.cpu_seconds.remote(), timeout=TIMEOUT_S)
        taking = consumer.take_for.remote(buffer, workers * episodes, seconds + 1.0)
        producing = [
            w.produce.remote(buffer, episodes, seconds, 10**9 * (i + 1))
            for i, w in enumerate(bench.workers[:workers])
        ]
        started = time.monotonic()
        results = wait_all(
            producing,
            "producers",
            lambda _: f"{max(0, seconds - (time.monotonic() - started)):.0f} s left",
        )
        cpu_after = ray.get(buffer.cpu_seconds.remote(), timeout=TIMEOUT_S)
        taken = ray.get(taking, timeout=TIMEOUT_S)
    finally:
        for actor in (buffer, consumer):
            ray.kill(actor)
    added = sum(r["added"] for r in results)
    trips = [t for r in results for t in r["round_trips"]]
    cpu_per_batch = (cpu_after - cpu_before) / max(added, 1)
    return {
        "buffer_batches_per_s": added / seconds,
        "buffer_episodes_per_s": added * episodes / seconds,
        "buffer_ceiling_batches_per_s": 1 / cpu_per_batch,
        "buffer_taken": taken,
        "buffer_cpu_ms_per_batch": 1e3 * cpu_per_batch,
        "buffer_round_trip_ms": 1e3 * statistics.median(trips) if trips else math.nan,
    }


# ---------------------------------------------------------------- b. the store


def measure_store(bench: Bench, workers: int, scratch: Path) -> dict[str, float]:
    """The store at each shard count of --store-shards, side by side: the figures of one
    store, and for more shards their episodes/s and its ratio to one store's."""
    figures: dict[str, float] = {}
    for shards in sorted(set(bench.args.store_shards) | {1}):
        measured = measure_store_shards(bench, workers, shards, scratch)
        if shards == 1:
            figures |= measured
        else:
            rate = measured["store_episodes_per_s"]
            figures[f"store_{shards}_shards_episodes_per_s"] = rate
            figures[f"store_{shards}_shards_over_one"] = rate / figures["store_episodes_per_s"]
    return figures


def measure_store_shards(
    bench: Bench, workers: int, shards: int, scratch: Path
) -> dict[str, float]:
    """Batches of realistic episodes made on the workers' nodes are stored, a learner
    step's batches a write, as the driver writes them (to each of `shards` store actors
    in turn); returns episodes/s, bytes/s and the stores' CPU per episode, after
    counting what they wrote."""
    args = bench.args
    batches = max(1, args.store_episodes // args.batch_episodes)
    sent = batches * args.batch_episodes
    print(f"  b. store: {sent} episodes from {workers} workers' nodes, {shards} store actor(s)")
    run_dir = Path(tempfile.mkdtemp(prefix=f"store-{workers}-{shards}-", dir=scratch))
    config = StoreConfig(path=str(run_dir / "episodes"))
    remote = REMOTE["profiled_store"].options(**bench.on_head())
    stores = [remote.remote(config, str(run_dir), RUN_ID, None, i) for i in range(shards)]
    try:
        pool = bench.workers[:workers]
        refs = [
            pool[i % workers].make_batch.remote(i * args.batch_episodes, args.batch_episodes)
            for i in range(batches)
        ]
        wait_all(refs, "batches made")
        wait_all([store.__ray_ready__.remote() for store in stores], "stores started")
        arrow_bytes = to_table(ray.get(refs[0], timeout=TIMEOUT_S)).nbytes * batches
        cpu_before = sum(ray.get([s.cpu_seconds.remote() for s in stores], timeout=TIMEOUT_S))
        started = time.perf_counter()
        step = args.step_batches
        writes = [
            stores[write % shards].append_batches.remote(
                [[ref] for ref in refs[i : i + step]], time.time(), TIMEOUT_S, uuid.uuid4().hex
            )
            for write, i in enumerate(range(0, batches, step))
        ]
        appended = sum(
            wait_all(writes, "store writes", lambda done: f"{done}/{len(writes)} writes stored")
        )
        closed = ray.get([store.close.remote() for store in stores], timeout=TIMEOUT_S)
        seconds = time.perf_counter() - started
        cpu = sum(ray.get([s.cpu_seconds.remote() for s in stores], timeout=TIMEOUT_S))
        cpu -= cpu_before
    finally:
        for store in stores:
            ray.kill(store)
    stored = count_stored(run_dir / "episodes")
    written = sum(stats.episodes_written for stats, _ in closed)
    check_stored_once(stored, sent, [appended, written], "store")
    parquet = sum(p.stat().st_size for p in (run_dir / "episodes").rglob("*.parquet"))
    return {
        "store_episodes_per_s": sent / seconds,
        "store_arrow_mb_per_s": arrow_bytes / seconds / 1e6,
        "store_parquet_mb_per_s": parquet / seconds / 1e6,
        "store_cpu_ms_per_episode": 1e3 * cpu / sent,
        "store_ceiling_episodes_per_s": sent / cpu,
        "store_sent": sent,
        "store_rows": stored["rows"],
    }


def count_stored(root: Path) -> dict[str, int]:
    """Returns the rows and the distinct episode ids of the Parquet files under `root`."""
    if not root.exists():
        return {"rows": 0, "ids": 0}
    ids = ds.dataset(root, format="parquet", partitioning="hive").to_table(["episode_id"])
    return {"rows": ids.num_rows, "ids": len(set(ids.column("episode_id").to_pylist()))}


def check_stored_once(stored: dict[str, int], sent: int, counted: list[int], what: str) -> None:
    """Raises unless every episode sent was stored once: as many rows, all distinct, and
    as many as the store's own counts say."""
    if stored["rows"] != sent or stored["ids"] != sent or any(c != sent for c in counted):
        raise AssertionError(f"{what}: sent {sent}, stored {stored}, counted {counted}")


# ---------------------------------------------------------------- c. weights


def measure_weights(bench: Bench, workers: int) -> dict[str, float]:
    """For each size: the learner publishes its weights once, and every one of W engines
    pulls them to its node, all at once and then, in turn with that, node by node as
    rollout.weight_relay orders it (relay_waves); returns the median seconds to publish
    and, after that, until the last engine holds them, each way."""
    figures: dict[str, float] = {}
    engines = bench.workers[:workers]
    nodes: list[str] = []
    head = bench.cluster.head_node.node_id
    for size_mb in bench.args.sizes_mb:
        publish, spread, relayed = [], [], []
        for version in range(bench.args.repeats):
            for relay in (False, True):
                started = time.perf_counter()
                published = bench.learner.publish.remote(2 * version + relay, size_mb * 2**20)
                ready, _ = ray.wait([published], timeout=TIMEOUT_S, fetch_local=False)
                assert ready, "the learner did not publish its weights in time"
                sent = time.perf_counter()
                waves = relay_waves(nodes, head) if relay else [list(range(len(engines)))]
                for wave in waves:
                    held = wait_all([engines[i].hold.remote([published]) for i in wave], "held")
                (relayed if relay else spread).append(time.perf_counter() - sent)
                nodes = nodes if relay else held  # each engine's node, from the flat pull
                publish.append(sent - started)
                del published
        publish_s, spread_s = statistics.median(publish), statistics.median(spread)
        relay_s = statistics.median(relayed)
        count = len(set(nodes))
        print(
            f"  c. weights: {size_mb} MiB to {workers} engines on {count} nodes: published "
            f"in {publish_s:.2f} s, held by all {spread_s:.2f} s later ({relay_s:.2f} s "
            f"node by node, in {len(relay_waves(nodes, head))} waves)"
        )
        figures[f"publish_{size_mb}mb_s"] = publish_s
        figures[f"broadcast_{size_mb}mb_s"] = spread_s
        figures[f"relay_{size_mb}mb_s"] = relay_s
        figures["weights_nodes"] = count
        into_nodes = size_mb * 2**20 * count / 1e9
        figures[f"broadcast_{size_mb}mb_gb_per_s"] = into_nodes / spread_s
    return figures


# ---------------------------------------------------------------- d. the driver


class DriverSteps:
    """The training driver's calls for one learner step, as TrainingDriver makes them
    (fill, _to_buffer, _take_and_start, train_step's store write) over rlray's own
    Rollouts, Recovery, StoreWrites and buffer actor. Weight syncs are left out (c
    measures them), and so is the staleness bound: no batch is ever stale here."""

    def __init__(self, bench: Bench, workers: int, buffer: Any, store: Any):
        pool = bench.workers[:workers]
        names = [f"sim-{i}" for i in range(workers)]
        self.actors = SimpleNamespace(
            rollout=pool, rollout_names=names, reward=pool, reward_names=names, agent=None
        )
        self.buffer, self.learner = buffer, bench.learner
        self.recovery = Recovery(self.actors, TIMEOUT_S, TIMEOUT_S)
        clock = PhaseClock()
        self.store = StoreWrites([("store", store)], self.recovery, clock)
        self.prompts_per_batch = max(1, bench.args.batch_episodes // SAMPLES)
        self.per_batch = self.prompts_per_batch * SAMPLES
        prompts = SimpleNamespace(row=lambda i: PromptRow(f"prompt {i}", {"answer": str(i)}))
        self.rollouts = Rollouts(self.actors, prompts, self.recovery, clock, self._to_buffer)
        self.per_step = workers * self.per_batch
        self.cursor = self.version = self.buffered_episodes = self.next_batch_id = 0
        self.stored = 0

    def fill(self) -> None:
        """One reservation for every idle worker, after TrainingDriver's count of every
        episode buffered or in flight (its staleness check: always true here, with no
        weight syncs, but made as the driver makes it)."""
        idle = self.rollouts.idle_workers()
        ahead = self.buffered_episodes + sum(i.num_episodes for i in self.rollouts.in_flight)
        planned = [w for w in idle if self.version + ahead // self.per_step >= self.version]
        if not planned:
            return
        sizes = [self.per_batch] * len(planned)
        reserve = lambda: self.buffer.reserve_batches.remote(sizes)  # noqa: E731
        reserved = self.recovery.retrying("buffer", reserve, "reserve")
        for worker in planned[:reserved]:
            self.rollouts.start(worker, self.cursor, self.prompts_per_batch, SAMPLES)
            self.cursor += self.prompts_per_batch

    def _to_buffer(self, items: list[InFlight]) -> None:
        added = []
        for item in items:
            batch = BufferedBatch(
                [item.episodes], 0, item.generated.episodes, item.first_prompt_index,
                self.next_batch_id,
            )  # fmt: skip
            self.next_batch_id += 1
            added.append((batch, item.num_episodes))
        add = lambda: self.buffer.add_batches.remote(added)  # noqa: E731
        self.recovery.retrying("buffer", add, "add")
        self.buffered_episodes += sum(batch.num_episodes for batch, _ in added)

    def step(self) -> None:
        """Fills the buffer to a step, takes it, trains on it and stores it."""
        while True:
            self.rollouts.poll()
            self.fill()
            if self.buffered_episodes >= self.per_step:
                take = lambda: self.buffer.take.remote(self.per_step, self.version)  # noqa: E731
                taken = self.recovery.retrying("buffer", take, "take")
                if taken is not None:
                    break
            self.rollouts.wait()
        self.buffered_episodes -= sum(b.num_episodes for b in taken.batches)
        refs = [b.ref for b in taken.batches]
        train = self.learner.train_on.remote(refs, TIMEOUT_S)
        self.version += 1
        self.fill()  # generation overlaps training
        self.recovery.call("learner", train, "train step")
        self.store.write(refs, trained_at=time.time())
        self.stored += sum(b.num_episodes for b in taken.batches)


def measure_driver(bench: Bench, workers: int, scratch: Path) -> dict[str, float]:
    """Runs learner steps of one batch per worker; returns the driver's median CPU and
    wall milliseconds per step, after counting the stored episodes."""
    steps, episodes = bench.args.steps, bench.args.batch_episodes
    print(f"  d. driver: {steps} steps of {workers} batches of about {episodes} episodes")
    run_dir = Path(tempfile.mkdtemp(prefix=f"driver-{workers}-", dir=scratch))
    capacity = (episodes + SAMPLES) * workers * 3
    buffer = REMOTE["buffer"].options(**bench.on_head()).remote(RUN_ID, capacity, 10**9)
    config = StoreConfig(path=str(run_dir / "episodes"))
    store = REMOTE["store"].options(**bench.on_head()).remote(config, str(run_dir), RUN_ID)
    try:
        driver = DriverSteps(bench, workers, buffer, store)
        driver.step()  # warm-up: every worker's first call
        cpu, wall = [], []
        for index in range(steps):
            cpu_started, started = time.process_time(), time.perf_counter()
            driver.step()
            cpu.append(time.process_time() - cpu_started)
            wall.append(time.perf_counter() - started)
            print(f"    step {index + 1}/{steps}: cpu {cpu[-1]:.3f} s, wall {wall[-1]:.3f} s")
        driver.rollouts.finished()  # batches still in flight: not stored, not counted
        stats = driver.store.close(TIMEOUT_S)
    finally:
        for actor in (buffer, store):
            ray.kill(actor)
    if stats is None:
        raise RuntimeError("the driver's store did not close (see the log above)")
    stored = count_stored(run_dir / "episodes")
    check_stored_once(stored, driver.stored, [stats.episodes_written], "driver's store writes")
    return {
        "driver_cpu_ms_per_step": 1e3 * statistics.median(cpu),
        "driver_wall_ms_per_step": 1e3 * statistics.median(wall),
        "driver_cpu_ms_per_batch": 1e3 * statistics.median(cpu) / workers,
        "driver_ceiling_batches_per_s": workers / statistics.median(cpu),
        "driver_stored": driver.stored,
    }


# ---------------------------------------------------------------- e. bookkeeping


def measure_bookkeeping(counts: list[int]) -> dict[int, dict[str, float]]:
    """The driver's scans of its batches in flight, in this process, beyond the worker
    counts a cluster here can hold: Rollouts.idle_workers and Rollouts._pending with a
    batch in flight on each of W workers (half generated, half being scored). Returns
    microseconds a call, and the milliseconds a step costs where every batch of the
    step finishes on its own (a wait each, and after each an idle_workers and two
    _pending: Rollouts.poll and wait, TrainingDriver.fill)."""
    print(f"e. the driver's scans of its batches in flight, in-process, at {counts} workers")
    results = {}
    for workers in counts:
        names = [f"sim-{i}" for i in range(workers)]
        actors = SimpleNamespace(
            rollout=names, rollout_names=names, reward=names, reward_names=names, agent=None
        )
        rollouts = Rollouts(actors, None, None, PhaseClock(), deliver=lambda item: None)
        done = GenerateStats("sim", 0, 64, 64, 0.0)
        rollouts.in_flight = [
            InFlight([], 0, i, i, 64, generated=done if i % 2 else None) for i in range(workers)
        ]
        for item in rollouts.in_flight:
            item.generate_stats, item.score_stats = object(), object()
        idle = per_call_seconds(rollouts.idle_workers)
        pending = per_call_seconds(rollouts._pending)
        results[workers] = {
            "idle_workers_us": 1e6 * idle,
            "pending_us": 1e6 * pending,
            "scans_ms_per_step": 1e3 * workers * (idle + 2 * pending),
        }
    return results


def per_call_seconds(call: Callable[[], Any], budget_s: float = 0.3) -> float:
    """Returns the median seconds of `call()` over five rounds of `budget_s` each."""
    rounds = []
    for _ in range(5):
        calls, started = 0, time.perf_counter()
        while time.perf_counter() - started < budget_s / 5:
            call()
            calls += 1
        rounds.append((time.perf_counter() - started) / calls)
    return statistics.median(rounds)


def print_bookkeeping(results: dict[int, dict[str, float]]) -> None:
    counts = sorted(results)
    print(f"{'figure':<48}" + "".join(f"{'N=' + str(n):>10}" for n in counts) + "  growth")
    labels = {
        "idle_workers_us": "e. Rollouts.idle_workers, us a call",
        "pending_us": "e. Rollouts._pending, us a call",
        "scans_ms_per_step": "e. both, ms a step (a wait a batch)",
    }
    for key, label in labels.items():
        values = [results[n][key] for n in counts]
        cells = "".join(f"{v:>10.1f}" for v in values)
        print(f"{label:<48}{cells}  {growth(counts, values)}")


# ---------------------------------------------------------------- the report

FIGURES = [
    ("buffer_batches_per_s", "a. buffer: batches/s added (all on 2 cores)", "{:.0f}"),
    ("buffer_episodes_per_s", "a. buffer: episodes/s added", "{:.0f}"),
    ("buffer_cpu_ms_per_batch", "a. buffer: its CPU ms per batch", "{:.2f}"),
    ("buffer_ceiling_batches_per_s", "a. buffer: batches/s a core of its own allows", "{:.0f}"),
    ("buffer_round_trip_ms", "a. buffer: producer's reserve+add, ms (median)", "{:.1f}"),
    ("store_episodes_per_s", "b. store: episodes/s", "{:.0f}"),
    ("store_arrow_mb_per_s", "b. store: MB/s of episodes (Arrow)", "{:.1f}"),
    ("store_parquet_mb_per_s", "b. store: MB/s written (Parquet, zstd)", "{:.1f}"),
    ("store_cpu_ms_per_episode", "b. store: its CPU ms per episode", "{:.2f}"),
    ("store_ceiling_episodes_per_s", "b. store: episodes/s a core of its own allows", "{:.0f}"),
    ("driver_cpu_ms_per_step", "d. driver: CPU ms per step", "{:.0f}"),
    ("driver_wall_ms_per_step", "d. driver: wall ms per step", "{:.0f}"),
    ("driver_cpu_ms_per_batch", "d. driver: CPU ms per batch", "{:.2f}"),
    ("driver_ceiling_batches_per_s", "d. driver: batches/s its core allows", "{:.0f}"),
]


def store_figures(shard_counts: list[int]) -> list[tuple[str, str, str]]:
    rows = []
    for shards in sorted(set(shard_counts) - {1}):
        key = f"store_{shards}_shards"
        rows.append((f"{key}_episodes_per_s", f"b. store, {shards} shards: episodes/s", "{:.0f}"))
        rows.append((f"{key}_over_one", f"b. store, {shards} shards: over one store", "{:.2f}"))
    return rows


def weight_figures(sizes_mb: list[int]) -> list[tuple[str, str, str]]:
    rows = [("weights_nodes", "c. nodes the engines are on", "{:.0f}")]
    for size in sizes_mb:
        rows.append((f"publish_{size}mb_s", f"c. weights {size} MiB: s to publish", "{:.2f}"))
        rows.append((f"broadcast_{size}mb_s", f"c. weights {size} MiB: s until all hold", "{:.2f}"))
        rows.append(
            (f"relay_{size}mb_s", f"c. weights {size} MiB: the same, node by node", "{:.2f}")
        )
        rows.append(
            (f"broadcast_{size}mb_gb_per_s", f"c. weights {size} MiB: GB/s into nodes", "{:.2f}")
        )
    return rows


def growth(counts: list[int], values: list[float]) -> str:
    """Returns how `values` grow with `counts`: the least-squares slope k of log value
    against log count, named constant (|k| < 0.3), linear (0.7-1.3), or N^k."""
    points = [(math.log(n), math.log(v)) for n, v in zip(counts, values, strict=True) if v > 0]
    if len(points) < 2:
        return "-"
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    k = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    if abs(k) < 0.3:
        return f"constant (N^{k:.2f})"
    if 0.7 <= k <= 1.3:
        return f"linear (N^{k:.2f})"
    return f"{'worse than linear' if k > 1.3 else 'between'} (N^{k:.2f})"


def print_table(
    nodes: int, results: dict[int, dict[str, float]], sizes_mb: list[int], store_shards: list[int]
) -> None:
    counts = sorted(results)
    print(f"\nresults, {nodes} nodes (N = workers)")
    header = f"{'figure':<48}" + "".join(f"{'N=' + str(n):>10}" for n in counts) + "  growth"
    print(header)
    print("-" * len(header))
    for key, label, fmt in FIGURES + store_figures(store_shards) + weight_figures(sizes_mb):
        values = [results[n].get(key) for n in counts]
        if all(v is None for v in values):
            continue
        cells = "".join(f"{'-' if v is None else fmt.format(v):>10}" for v in values)
        known = [(n, v) for n, v in zip(counts, values, strict=True) if v is not None]
        trend = growth([n for n, _ in known], [v for _, v in known])
        print(f"{label:<48}{cells}  {trend}")


def print_node_growth(results: dict[int, dict[int, dict[str, float]]], sizes_mb: list[int]) -> None:
    """The broadcast against the number of nodes, at the largest worker count each has."""
    if len(results) < 2:
        return
    print("\nweights against nodes (each at its largest worker count)")
    for size in sizes_mb:
        key = f"broadcast_{size}mb_s"
        points = [(n, by_w[max(by_w)].get(key)) for n, by_w in sorted(results.items())]
        points = [(n, v) for n, v in points if v is not None]
        cells = ", ".join(f"{n} nodes {v:.2f} s" for n, v in points)
        trend = growth([n for n, _ in points], [v for _, v in points])
        print(f"  {size} MiB: {cells}  growth with nodes: {trend}")


# ---------------------------------------------------------------- main


def run_cluster(nodes: int, args: argparse.Namespace, scratch: Path) -> dict[int, dict]:
    """Starts a cluster of `nodes` worker nodes, measures at each worker count, stops it."""
    bench = start_cluster(nodes, args)
    results: dict[int, dict] = {}
    try:
        for workers in sorted(args.workers):
            if free_gib() < args.min_free_gib:
                print(f"  skipping {workers} workers and more: {free_gib():.1f} GiB free")
                break
            print(f"\n{workers} workers on {nodes} nodes ({free_gib():.1f} GiB free)")
            bench.grow(workers)
            figures: dict[str, float] = {}
            figures |= measure_buffer(bench, workers)
            figures |= measure_store(bench, workers, scratch)
            figures |= measure_weights(bench, workers)
            figures |= measure_driver(bench, workers, scratch)
            results[workers] = figures
    finally:
        ray.shutdown()
        bench.cluster.shutdown()
    print_table(nodes, results, args.sizes_mb, args.store_shards)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small version of every part")
    parser.add_argument("--nodes", type=int, nargs="+", help="worker nodes of each cluster")
    parser.add_argument("--workers", type=int, nargs="+", help="stand-in workers to measure at")
    parser.add_argument("--sizes-mb", type=int, nargs="+", help="weights sizes (MiB)")
    parser.add_argument("--buffer-seconds", type=float, help="how long producers fill the buffer")
    parser.add_argument("--store-episodes", type=int, help="episodes stored at each count")
    parser.add_argument("--steps", type=int, help="driver steps timed at each count")
    parser.add_argument("--repeats", type=int, help="weight broadcasts at each size")
    parser.add_argument("--batch-episodes", type=int, default=64, help="episodes in a batch")
    parser.add_argument("--step-batches", type=int, default=4, help="batches in a store write")
    parser.add_argument(
        "--store-shards", type=int, nargs="+", default=[1], help="store shards, side by side"
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument(
        "--min-free-gib", type=float, default=3.0, help="add no workers below this free memory"
    )
    parser.add_argument(
        "--bookkeeping-workers",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="worker counts of the in-process driver scans (e)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    full = {
        "nodes": [4, 16],
        "workers": [8, 32, 64],
        "sizes_mb": [64, 256],
        "buffer_seconds": 8.0,
        "store_episodes": 4096,
        "steps": 5,
        "repeats": 3,
    }
    quick = {
        "nodes": [4],
        "workers": [4, 8],
        "sizes_mb": [16],
        "buffer_seconds": 2.0,
        "store_episodes": 512,
        "steps": 3,
        "repeats": 1,
    }
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"nodes {args.nodes}, workers {args.workers}, weights {args.sizes_mb} MiB, "
        f"{free_gib():.1f} GiB free"
    )
    bookkeeping = measure_bookkeeping(args.bookkeeping_workers)
    print_bookkeeping(bookkeeping)
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlray-control-plane-") as scratch:
        for nodes in args.nodes:
            results[nodes] = run_cluster(nodes, args, Path(scratch))
    print_node_growth(results, args.sizes_mb)
    print("\ne. (again)")
    print_bookkeeping(bookkeeping)
    if args.json:
        figures = {"args": vars(args) | {"json": None}, "results": results}
        args.json.write_text(json.dumps(figures | {"bookkeeping": bookkeeping}))


if __name__ == "__main__":
    main()
