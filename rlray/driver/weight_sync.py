"""Weight syncs: the learner's weights onto every rollout worker, and the parity check.

Three paths. With the roles disaggregated (rollout.weight_sync): the object store, where
the learner publishes its weights once as one immutable object that every worker loads,
all at once (no worker can load half a version); or vLLM's weight transfer (NCCL on
GPUs, gloo on CPU), where the learners send each tensor straight into the workers'
engines. A restarted worker loads the published weights, published anew if the last
sync went by transfer. Colocated (ray.placement colocated): each engine takes its own
learner's weights in memory, in its process.

With buffer.max_staleness >= 1 a sync is checked on its own: a few episodes of the step's
batch are scored by the learner and by a rollout engine that just loaded its weights,
which compares the two (rollout.parity_check_every, rlray.core.parity); the next step
reports the gap unless its own batch shows parity. With 0, every training batch is made
by the weights the learner holds, and its own logprobs show parity.

A sync may let the next learner step start before it ends (`sync(start_next=...)`): the
learner's calls run in order, so that step starts once the weights are published, and
trains while the workers load them and the check runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlray.cluster.calls import ActorFailure
from rlray.cluster.roles import CONTROL
from rlray.cluster.start import Actors
from rlray.cluster.telemetry import Telemetry
from rlray.config import Config, weight_sync
from rlray.driver.recovery import Recovery
from rlray.driver.weight_relay import NodeRelay
from rlray.observe.timing import PhaseClock

logger = logging.getLogger(__name__)

Loaded = dict[str, tuple[int, float | None]]
"""Per worker name: the version it holds and its load seconds (None: not measured)."""


@dataclass
class Waves:
    """An object-store sync's loads: the workers (indices) of each wave, in order, and
    the loads of the first wave, asked for when the weights were published."""

    workers: list[list[int]]
    first: dict[int, Any]


class WeightSync:
    """Keeps every rollout worker at the learner's version; knows which each holds."""

    def __init__(
        self,
        config: Config,
        actors: Actors,
        recovery: Recovery,
        clock: PhaseClock,
        telemetry: Telemetry,
        version: int,
    ):
        self.config = config
        self.actors = actors
        self.recovery = recovery
        self.clock = clock
        self.telemetry = telemetry
        self.worker_versions = [version] * len(actors.rollout)
        self.transfer = weight_sync(config)  # object_store, nccl or gloo
        self.transfer_open = False  # the learners' weight transfer to the workers
        self.published: Any = None  # ObjectRef of the last published weights
        self.syncs = 0
        self.last_gap: float | None = None
        """The parity gap of the last checked sync, until the next step reports it."""
        self.relay = NodeRelay(actors, recovery) if config.rollout.weight_relay else None
        recovery.restorers["rollout"] = self._reload

    def sync(self, start_next: Callable[[], None] | None = None) -> dict[str, Any]:
        """Publishes the learner's weights once and loads them on every rollout worker;
        returns the sync's record: its path, wall time, the slowest worker's load time
        and the version each worker holds. With the object-store path, `start_next` is
        called once the publish and the loads are asked for, before they are waited for:
        it may start the next learner step, which then trains beside the loads and the
        parity check."""
        self.syncs += 1
        checked = self.config.buffer.max_staleness > 0 and (
            self.syncs % self.config.rollout.parity_check_every == 0
        )
        # Asked first: the learner's calls run in order, so it is of the weights published.
        sample = self.actors.learner.parity_sample.remote() if checked else None
        started = time.perf_counter()
        if self.transfer == "object_store":
            loads = self._publish()
            if start_next is not None:
                start_next()  # its own phases (buffer) while the loads run
        with self.clock.phase("weight_sync"):
            if self.transfer == "object_store":
                path, loaded = "object_store", self._wait_for_loads(loads)
            elif self.transfer == "in_memory":
                path, loaded = "in_memory", self._load_in_memory()
            else:
                path, loaded = self._send()
            seconds = time.perf_counter() - started
        if sample is not None:
            with self.clock.phase("parity_check"):
                self._check_parity(sample)
        self.telemetry.set("rlray_weight_sync_seconds", seconds)
        load_seconds = [s for _, s in loaded.values() if s is not None]
        return {
            "weight_sync": path,
            "weight_sync_seconds": seconds,
            "weight_load_seconds": max(load_seconds) if load_seconds else None,
            "weight_versions_loaded": {name: version for name, (version, _) in loaded.items()},
        }

    def take_gap(self) -> float | None:
        """Returns the last checked sync's parity gap, once."""
        gap, self.last_gap = self.last_gap, None
        return gap

    def _publish(self) -> Waves:
        """The object-store sync's asks: the learner publishes one object, and the
        workers load it: all at once, or with rollout.weight_relay in waves, node by node
        (rlray.driver.weight_relay). Returns the waves, the first one's loads asked."""
        self.published = self.actors.learner.publish_weights.remote()
        waves = self.relay.waves() if self.relay else [list(range(len(self.actors.rollout)))]
        return Waves(waves, self._load(waves[0]))

    def _load(self, workers: list[int]) -> dict[int, Any]:
        """Asks the workers to load the published weights; returns each one's load."""
        rollout = self.actors.rollout
        return {worker: rollout[worker].load_published.remote(self.published) for worker in workers}

    def _publish_and_load(self) -> Loaded:
        """The object-store sync, asked and waited for."""
        return self._wait_for_loads(self._publish())

    def _wait_for_loads(self, waves: Waves) -> Loaded:
        """Waits for the workers' loads, a wave at a time, asking for each wave's once the
        one before has loaded. A worker that died is waited for and loads the published
        weights when restarted (its load seconds are then None)."""
        names = self.actors.rollout_names
        loaded: Loaded = {}
        loads = waves.first
        for wave in waves.workers:
            loads = loads or self._load(wave)
            for worker, load in loads.items():
                name = names[worker]
                try:
                    version, seconds = self.recovery.call(name, load, "weight load")
                except ActorFailure as err:
                    if not err.died or err.lost:
                        raise
                    self.recovery.recover(name, err)  # loads the published weights when up
                    loaded[name] = (self.worker_versions[worker], None)
                    continue
                self.worker_versions[worker] = version
                loaded[name] = (version, seconds)
            loads = {}
        return dict(sorted(loaded.items(), key=lambda item: names.index(item[0])))

    def _load_in_memory(self) -> Loaded:
        """The colocated sync: every engine loads its own learner's weights, all at once.
        A colocated actor is not restarted: its death ends the attempt as a learner's."""
        names = self.actors.rollout_names
        loads = [actor.load_learner_weights.remote() for actor in self.actors.rollout]
        loaded: Loaded = {}
        for worker, (name, load) in enumerate(zip(names, loads, strict=True)):
            version, seconds = self.recovery.call(name, load, "weight load")
            self.worker_versions[worker] = version
            loaded[name] = (version, seconds)
        return loaded

    def _send(self) -> tuple[str, Loaded]:
        """vLLM's weight transfer: the learners send (rank 0 broadcasting into every
        worker's engine); opened at the first sync and again after a worker's restart.

        If the transfer fails while the learner lives (a worker died or failed mid-send),
        a lone learner closes it and this sync goes through the object store (a dead
        worker is waited for and loads there too). In a group that ends the attempt as a
        learner death does: its learners may be stuck in different gathers, so the job
        resumes from its checkpoint with new actors (ray.max_job_restarts)."""
        learner = self.actors.learner
        try:
            if not self.transfer_open:
                self._open_transfer()
            version = self.recovery.call("learner", learner.send_weights.remote(), "sync")
        except ActorFailure as failure:
            if failure.died:  # the learner died: reported as such
                self._abandon_transfer(failure)
                raise
            if self.config.learner.num_workers > 1:
                self._abandon_transfer(failure)
                raise ActorFailure(f"weight transfer failed: {failure}", died=True) from failure
            logger.warning("weight transfer failed (%s); syncing through the object store", failure)
            self.transfer_open = False
            closed = learner.close_weight_transfer.remote()
            self.recovery.call("learner", closed, "closing the weight transfer")
            return "object_store", self._publish_and_load()
        self.published = None  # the last published object is no longer the weights
        self.worker_versions = [version] * len(self.actors.rollout)
        return self.transfer, {name: (version, None) for name in self.actors.rollout_names}

    def _abandon_transfer(self, failure: ActorFailure) -> None:
        """The learners will not finish the transfer: an update they started may hold the
        workers' engines, their weights half-loaded. Each engine stops for good (on its
        actor's CONTROL thread, free while the transfer's calls are stuck), so that
        nothing waits for it: its batches in flight fail, and the resumed run starts new
        actors. Without this, the run's end waited for them until the call timeout."""
        reason = str(failure).splitlines()[0]
        names, actors = self.actors.rollout_names, self.actors.rollout
        calls = [
            (name, actor.abandon_weight_update.options(concurrency_group=CONTROL).remote(reason))
            for name, actor in zip(names, actors, strict=True)
        ]
        for name, call in calls:
            try:
                self.recovery.call(name, call, "abandoning the weight transfer")
            except ActorFailure as err:  # a dead worker's engine holds nothing
                logger.warning("%s", err)

    def _open_transfer(self) -> None:
        learners = self.actors.learner
        rendezvous = learners.handles[0].rendezvous.remote()
        address, port = self.recovery.call("learner", rendezvous, "sync")
        ranks = self.config.rollout.tensor_parallel_size  # each worker's engine's ranks
        workers = list(zip(self.actors.rollout_names, self.actors.rollout, strict=True))
        opened = learners.open_weight_transfer.remote(
            self.transfer, address, port, workers, ranks, self.recovery.timeout_s
        )
        self.recovery.call("learner", opened, "opening the weight transfer")
        self.transfer_open = True

    def _check_parity(self, sample: Any) -> None:
        """Has rollout worker 0's engine score the learner's sample of the step's batch
        (a prefill) and compare it with the learner's logprobs: the gap the next step
        reports. A worker that died meanwhile is brought back (it loads the weights) and
        checks then; only a second death in the one check leaves the sync unchecked."""
        name = self.actors.rollout_names[0]
        for _ in range(2):
            checked = self.actors.rollout[0].parity_gap.remote(sample)
            try:
                self.last_gap = self.recovery.call(name, checked, "parity check")
            except ActorFailure as failure:
                if not failure.died or failure.lost:
                    raise
                self.recovery.recover(name, failure)  # raises if the learner died
                continue
            self.telemetry.set("rlray_logprob_parity_error", self.last_gap)
            return
        logger.warning("%s died twice in one parity check; this sync's is not checked", name)

    def _reload(self, name: str) -> None:
        """Loads the current weights on a restarted rollout worker."""
        if self.published is None:  # weights sent by transfer: publish them now
            self.published = self.actors.learner.publish_weights.remote()
        worker = self.actors.rollout_names.index(name)
        rollout = self.actors.rollout[worker]
        version, _ = self.recovery.retrying(
            name, lambda: rollout.load_published.remote(self.published), "weight load"
        )
        self.worker_versions[worker] = version
        self.transfer_open = False  # its new engine joins at the next sync
        if self.relay is not None:
            self.relay.moved(worker)  # perhaps to another node
