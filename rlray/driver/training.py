"""The training driver: rollouts into the buffer, learner steps from it, weight syncs,
evaluations, checkpoints, and every scored episode into the store.

It composes the driver's parts, each in a file of its own: the batches in flight
(rollouts.py), actor restarts (recovery.py), weight syncs (weight_sync.py), store writes
(store_writes.py) and evaluations (evaluation.py). This file holds what is the training
run's own: how far generation may run ahead of the learner, the buffer's batches, and
learner steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from rlray.cluster.calls import ActorFailure
from rlray.cluster.start import Actors
from rlray.cluster.telemetry import Telemetry
from rlray.config import Config, partial_rollouts
from rlray.core.interrupts import interrupts_held
from rlray.core.stats import StoreStats, metrics_dict
from rlray.driver.evaluation import Evaluation, Evaluator, PendingEvaluation
from rlray.driver.plan import RunPlan
from rlray.driver.prompt_queue import PromptQueue
from rlray.driver.recovery import Recovery
from rlray.driver.rollouts import InFlight, Rollouts
from rlray.driver.store_writes import StoreWrites
from rlray.driver.weight_sync import WeightSync
from rlray.episodes.buffer import BufferedBatch, TakenBatches
from rlray.observe.timing import PhaseClock

logger = logging.getLogger(__name__)


def _first_prompt_index(item: InFlight) -> int:
    """Returns the lowest prompt index of a generated batch: partial rollouts may return
    groups an earlier call started."""
    returned = item.generated.first_prompt_index
    return item.first_prompt_index if returned is None else min(returned, item.first_prompt_index)


def _batches_per_worker(config: Config) -> int:
    """Returns how many batches a rollout worker generates at once: two with in-flight
    weight updates (disaggregated: a colocated engine runs one call at a time)."""
    return 2 if config.rollout.in_flight_updates and config.ray.placement != "colocated" else 1


class PlannedBatch(NamedTuple):
    """A batch `fill` would start: on a worker, from a prompt, and its carry floor (with
    partial rollouts: the oldest version a group it leaves running may start under)."""

    worker: int
    first_prompt: int
    prompts: int
    carry_floor: int | None


class TrainingDriver:
    """Schedules generation, scoring, buffering, learning and weight syncs of one run.

    Generation runs ahead of the learner only as far as `buffer.max_staleness` allows:
    a batch is started only if the policy that makes it will be at most K versions
    behind the learner when that batch is trained on. K=0 is strictly on-policy.

    Rollout, reward and store (+ buffer) actors are restarted by Ray when they die; the
    driver keeps what it needs to carry on without losing or doubling an episode: the
    rows of every batch in flight (regenerated, with new episode ids, if its rollout
    worker died; re-scored if its reward worker died), a copy of the buffer's references
    (restored into a restarted buffer), and every store write until the store confirms
    it (resent under the same key, which the store recognises). Episodes are stored as
    trained only after the learner step that used them succeeded.
    """

    def __init__(self, plan: RunPlan, actors: Actors, version: int, prompt_cursor: int):
        config = plan.config
        self.config = config
        self.plan = plan
        self.actors = actors
        self.learner_version = version
        self.prompt_queue = PromptQueue(prompt_cursor, plan.replay_prompts())
        self.clock = PhaseClock()
        self.telemetry = Telemetry(plan.run_id)
        self.recovery = Recovery(
            actors, config.ray.call_timeout_s, config.ray.actor_start_timeout_s
        )
        self.store = StoreWrites(actors.stores(), self.recovery, self.clock)
        self.weights = WeightSync(
            config, actors, self.recovery, self.clock, self.telemetry, version
        )
        self.rollouts = Rollouts(
            actors,
            plan.prompts,
            self.recovery,
            self.clock,
            deliver=self._to_buffer,
            split_uniform_groups=config.algorithm.drop_uniform_groups,
            batches_per_worker=_batches_per_worker(config),
        )
        self.rollouts.step_version = version
        self.evaluator = Evaluator(actors, plan.eval_rows, config.eval, self.recovery, self.clock)
        self.buffered_episodes = 0
        self.buffered: dict[int, BufferedBatch] = {}
        """The buffer's batches of this driver (added, not yet taken), by batch id."""
        self.reserved_episodes = 0
        self.next_batch_id = 0
        self.training: list[BufferedBatch] = []
        """The batches of the learner step under way (stored once it succeeded)."""
        self.evaluation_due: int | None = None
        """The version whose evaluation the next step starts beside its training."""
        self.pending_evaluation: PendingEvaluation | None = None
        self.next_step: tuple[Any, TakenBatches] | None = None
        """The learner step a sync started (its ObjectRef and batches), not yet waited for."""
        self.recovery.restorers["buffer"] = self._restore_buffer

    # ------------------------------------------------------------------ generation

    def _episodes_ahead(self) -> int:
        """Returns the episodes buffered or in flight: trained before a batch started now."""
        return self.buffered_episodes + sum(item.num_episodes for item in self.rollouts.in_flight)

    def _trained_at_version(self, ahead: int) -> int:
        """Returns the learner version a batch started after `ahead` episodes will be
        trained at, counting those as trained first."""
        return self.learner_version + ahead // self.config.learner.episodes_per_step

    def fill(self) -> None:
        """Starts a batch on every idle rollout worker that may generate, as many as the
        buffer has room for: one reservation for them all (a round trip per worker took
        the driver's time as workers grew)."""
        samples = self.config.rollout.samples_per_prompt
        planned = self._batches_to_start()
        if not planned:
            return
        sizes = [batch.prompts * samples for batch in planned]
        with interrupts_held():
            reserved = self.buffer_call(
                lambda: self.actors.buffer.reserve_batches.remote(sizes), "reserve"
            )
            for batch in planned[:reserved]:  # the rest waits until the learner takes a step
                self.reserved_episodes += batch.prompts * samples
                self.prompt_queue.hand_out(batch.first_prompt, batch.prompts)
                self.rollouts.start(
                    batch.worker, batch.first_prompt, batch.prompts, samples, batch.carry_floor,
                    score=False,
                )  # fmt: skip
            self.rollouts.score_started()

    def _batches_to_start(self) -> list[PlannedBatch]:
        """Returns the batch each idle worker would start, in order, each counted as
        started for the next: on a worker whose weights will still be fresh (at most
        `buffer.max_staleness` versions behind) when the batch is trained on."""
        rollout = self.config.rollout
        max_staleness = self.config.buffer.max_staleness
        idle = self.rollouts.idle_workers()
        upcoming = iter(self.prompt_queue.next_batches(rollout.prompts_per_batch, len(idle)))
        planned: list[PlannedBatch] = []
        ahead = self._episodes_ahead()
        for worker in idle:
            trained_at = self._trained_at_version(ahead)
            if trained_at - self.weights.worker_versions[worker] > max_staleness:
                continue
            first, prompts = next(upcoming)
            # With partial rollouts, a group left running by the batch comes back with the
            # worker's next batch, trained a version later at most: still fresh then.
            floor = trained_at + 1 - max_staleness if partial_rollouts(self.config) else None
            planned.append(PlannedBatch(worker, first, prompts, floor))
            ahead += prompts * rollout.samples_per_prompt
        return planned

    def _to_buffer(self, items: list[InFlight]) -> None:
        """Adds scored batches to the buffer, in one call, and stores the groups
        dynamic sampling split off them."""
        added = [(self._buffered_batch(item), item.num_episodes) for item in items]
        # An agent trace may make more episodes than it reserved, or none.
        self.buffer_call(lambda: self.actors.buffer.add_batches.remote(added), "add")
        for batch, reserved in added:
            self.reserved_episodes -= reserved
            if batch.num_episodes:
                self.buffered[batch.batch_id] = batch
            self.buffered_episodes += batch.num_episodes
        split_off = [
            [i.uniform] for i in items if i.uniform is not None and i.scored.uniform_episodes
        ]
        if split_off:
            self.store.write(split_off, trained_at=None)  # never trained on, kept

    def _buffered_batch(self, item: InFlight) -> BufferedBatch:
        score = item.scored
        self.next_batch_id += 1
        return BufferedBatch(
            ref=[item.episodes],
            policy_version=item.generated.policy_version,
            num_episodes=item.generated.episodes - score.uniform_episodes,
            first_prompt_index=_first_prompt_index(item),
            batch_id=self.next_batch_id - 1,
            # An agent batch's episodes are its traces' model calls, more than it reserved:
            # a step may take part of it (rollout batches are sized to steps).
            group_sizes=score.group_sizes if self.actors.agent is not None else [],
            group_prompts=score.group_prompts,
        )

    def _restore_buffer(self, name: str) -> None:
        batches = list(self.buffered.values())
        restored = self.actors.buffer.restore.remote(batches, self.reserved_episodes)
        self.recovery.call("buffer", restored, "restore")

    def buffer_call(self, call: Callable[[], Any], what: str) -> Any:
        with self.clock.phase("buffer"):
            return self.recovery.retrying("buffer", call, what)

    # ------------------------------------------------------------------ learning

    def train_step(self) -> dict[str, Any]:
        """Fills the buffer to one learner step, trains on it (or on the step the last
        sync started), and returns the step's metrics (learner, buffer and rollout
        figures together)."""
        started, self.next_step = self.next_step, None
        train, taken = started or self._take_and_start()
        if self.actors.ingest is not None:
            self.actors.ingest.set_step.remote(self.learner_version)
        if self.evaluation_due is not None:  # rollout-0 evaluates while the learner trains
            self.pending_evaluation = self.evaluator.start(self.evaluation_due)
            self.evaluation_due = None
        self.fill()  # with max_staleness >= 1 generation overlaps training
        with self.clock.phase("training"):
            metrics = metrics_dict(self.recovery.call("learner", train, "train step"))
        gap = self.weights.take_gap()
        if metrics["logprob_parity_error"] is None:  # nothing fresh: the last sync's check
            metrics["logprob_parity_error"] = gap
        # Only now are they trained on: a learner that died mid-step leaves them untrained.
        with interrupts_held():
            self.store.write([b.ref for b in self.training], trained_at=time.time())
            self.training = []
        tally = self.rollouts.take_tally()
        return {
            **metrics,
            # As the step's take left them: the driver adds no batch while it trains.
            "buffer_depth": taken.depth_episodes,
            "dropped_stale": taken.dropped_stale_episodes,
            "dropped_stale_this_step": sum(b.num_episodes for b in taken.dropped),
            "rollout_tokens_per_s": tally.tokens_per_s(),
            "reward_seconds": tally.reward_seconds,
            "reward_wait_seconds": tally.reward_wait_seconds,
            # Every component, 0 where none failed or no batch was scored since the last step.
            "reward_failures": {
                spec.name: tally.reward_failures.get(spec.name, 0)
                for spec in self.config.reward.functions
            },
            "reward_dropped_episodes": tally.reward_dropped,
            "prompts_generated": tally.prompts_generated,
            "dropped_uniform_groups": tally.uniform_groups,
            "dropped_uniform_episodes": tally.uniform_episodes,
            "worker_policy_versions": tally.per_worker_version,
            "episodes_updated_in_flight": tally.updated_in_flight,
            "agent_traces_dropped": tally.traces_dropped,
            "tool_calls": tally.tool_calls,
            "tool_call_success_rate": tally.tool_call_success_rate(),
            "actor_restarts": self.recovery.count_restarts(),
        }

    def _take_and_start(self) -> tuple[Any, TakenBatches]:
        """Takes one learner step's batches from the buffer, waiting for generation as
        needed, and starts the step; returns its ObjectRef and what was taken."""
        per_step = self.config.learner.episodes_per_step
        while True:
            self.rollouts.poll()  # batches scored while the driver was busy go in first
            self.fill()
            if self._may_fill_a_step(per_step):
                with interrupts_held():  # batches taken are in `training` before a Ctrl-C acts
                    taken = self.buffer_call(
                        lambda: self.actors.buffer.take.remote(per_step, self.learner_version),
                        "take",
                    )
                    if taken is not None:
                        return self._start_training(taken), taken
            if not self.rollouts.in_flight:
                raise RuntimeError("nothing in flight and the buffer cannot fill a learner step")
            self.rollouts.wait()

    def _may_fill_a_step(self, per_step: int) -> bool:
        """Whether a take may fill a learner step. The driver counts every episode it
        added and has not seen taken or dropped; with no ingest endpoint adding episodes
        of its own, a take below that count comes back empty, and is not asked for."""
        return self.actors.ingest is not None or self.buffered_episodes >= per_step

    def _start_training(self, taken: TakenBatches) -> Any:
        """Moves the batches taken from the buffer to `training`, stores the stale ones
        and starts the learner step; returns the step's ObjectRef."""
        for batch in taken.batches + taken.dropped:
            self.buffered.pop(batch.batch_id, None)
        if taken.rest is not None:  # a batch split between this step and the next
            self.buffered[taken.rest.batch_id] = taken.rest
        self.buffered_episodes -= sum(
            b.num_episodes for b in taken.batches + taken.dropped if not b.external
        )
        self.training = taken.batches
        refs = [b.ref for b in taken.batches]
        train = self.actors.learner.train_on.remote(refs, self.recovery.timeout_s)
        self.store.write([b.ref for b in taken.dropped], trained_at=None)
        self.learner_version += 1
        self.rollouts.step_version = self.learner_version
        return train

    def sync_weights(self, start_next: bool = False) -> dict[str, Any]:
        """Loads the learner's weights on every rollout worker; returns the sync's record.
        With `start_next`, where the run allows it (`overlaps_sync`), the next learner
        step starts once the weights are published and trains while the workers load
        them: the caller must ask the learner for nothing else before that step."""
        if start_next and self.overlaps_sync():
            return self.weights.sync(start_next=self._start_next_step)
        return self.weights.sync()

    def overlaps_sync(self) -> bool:
        """Whether the next learner step may start during this sync: the object-store
        path, generation allowed to run a version ahead, and a step's episodes already
        buffered or on their way (made by the weights before this sync)."""
        config = self.config
        return (
            config.learner.overlap_sync
            and self.weights.transfer == "object_store"
            and config.buffer.max_staleness >= 1
            and not config.rollout.in_flight_updates
            and not config.agent.enabled
            and self._trained_at_version(self._episodes_ahead()) > self.learner_version
        )

    def _start_next_step(self) -> None:
        self.next_step = self._take_and_start()

    def evaluate(self) -> Evaluation:
        """Returns the held-out evaluation of the current policy."""
        return self.evaluator.evaluate(self.learner_version)

    @property
    def evaluates_beside_training(self) -> bool:
        """Whether an evaluation may run beside the next step's training: in the
        disaggregated placement rollout-0 idles for part of each step (eval.beside_training)."""
        return self.config.eval.beside_training and self.config.ray.placement != "colocated"

    def evaluate_beside_next_step(self) -> None:
        """Has the next train_step start the held-out evaluation of the current policy
        once its training has started; `finish_evaluation` returns it after the step,
        before the weights on rollout-0 change."""
        self.evaluation_due = self.learner_version

    def finish_evaluation(self) -> Evaluation:
        """Returns the evaluation started beside the last step's training."""
        if self.pending_evaluation is None:
            raise RuntimeError("finish_evaluation without an evaluation beside training")
        pending, self.pending_evaluation = self.pending_evaluation, None
        return self.evaluator.finish(pending)

    def save_checkpoint(self, publish: bool = True) -> Path:
        """Saves a checkpoint. It records the prompt cursor (the next prompt never handed
        out) and every prompt handed out and not yet trained on: in flight, carried in an
        engine, buffered or in a step under way; a resumed run regenerates exactly those
        first, and trains none twice. Without `publish` it stays staged (its staging
        directory is returned) until `publish_staged`."""
        with self.clock.phase("checkpoint"):
            pending = self.rollouts.open_prompts() | set(self.prompt_queue.replay)
            held = list(self.buffered.values()) + self.training
            pending.update(p for b in held if not b.external for p in b.group_prompts)
            run_dir = str(self.plan.run_dir)
            ref = self.actors.learner.save_checkpoint.remote(
                run_dir, self.prompt_queue.cursor, publish, sorted(pending)
            )
            return self.recovery.call("learner", ref, "save checkpoint")

    def publish_staged(self, version: int, keep: bool) -> Path | None:
        """Publishes the checkpoint of `version` left staged (returns its path) or
        discards it (None)."""
        with self.clock.phase("checkpoint"):
            run_dir = str(self.plan.run_dir)
            ref = self.actors.learner.publish_staged.remote(run_dir, version, keep)
            return self.recovery.call("learner", ref, "publish checkpoint")

    # ------------------------------------------------------------------ the end

    def drain(self) -> None:
        """Waits for in-flight batches and sends them, and whatever the buffer still
        holds, to the store as never trained on: every scored episode is kept."""
        if partial_rollouts(self.config):
            self.rollouts.finish_carried()
        for item in self.rollouts.finished():
            self.store.write([[item.episodes]], trained_at=None)
            if item.uniform is not None:
                self.store.write([[item.uniform]], trained_at=None)
        if self.training:  # the learner step did not finish: not trained on
            self.store.write([b.ref for b in self.training], trained_at=None)
            self.training = []
        if self.actors.buffer is not None:
            leftovers = self.buffer_call(lambda: self.actors.buffer.drain.remote(), "drain")
            self.store.write([b.ref for b in leftovers], trained_at=None)
            self.buffered.clear()
        self.store.confirm(block=True)

    def close_store(self) -> StoreStats | None:
        """Sends every episode not yet stored to the store, closes it (writing its
        buffered rows, waiting for uploads) and returns its stats; None if the store
        could not be closed (the reason is logged)."""
        try:
            self.drain()
        except ActorFailure as err:
            logger.warning("episodes not yet written may be lost: %s", err)
            return None
        return self.store.close(self.config.store.upload_timeout_s)
