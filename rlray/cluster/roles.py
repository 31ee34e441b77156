"""The Ray faces of the rollout, reward, buffer and store roles.

`RolloutWorker`, `RewardWorker`, `EpisodeBuffer` and `EpisodeStore` are plain classes;
each face here adds only what needs Ray: fetching episode references from the object
store, Ray metrics for the dashboard, and refusing calls after a restart until the
caller restored what the actor held. rlray.cluster.start starts them as named actors;
the learners' faces are in rlray.cluster.learners, the HTTP endpoints' in
rlray.cluster.endpoints (apart, so that no other actor imports aiohttp for them).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rlray.cluster.calls import ActorRestarted, _restarted, resolve_episodes
from rlray.cluster.telemetry import Telemetry
from rlray.config import StoreConfig
from rlray.core.episode import Episode
from rlray.core.evaluation import EvalEpisodes, EvalSample
from rlray.core.idle_cores import CoreLender
from rlray.core.prompt import PromptRow
from rlray.core.stats import EvalResult, GenerateStats, ScoreStats, StoreStats
from rlray.episodes.buffer import BufferedBatch, EpisodeBuffer, TakenBatches
from rlray.episodes.store import mark_trained, open_store
from rlray.observe.console import send_engine_output_to
from rlray.rewards.worker import RewardWorker
from rlray.rollout.sampling import Generated, ModelCall
from rlray.rollout.worker import RolloutWorker

if TYPE_CHECKING:
    from rlray.weights.packing import PackedWeights


CONTROL = "control"
"""A rollout actor's concurrency group (one thread of its own) for the call that must not
queue behind its others: abandon_weight_update, while a dead learner's transfer calls are
stuck in it. Declared where the workers take vLLM's weight transfer (rollout_actor_class);
with one call at a time, calls otherwise run on the actor's main thread."""


def rollout_actor_class(weight_transfer: bool) -> Any:
    """Returns RolloutActor as a Ray actor class, with its CONTROL group where the workers
    take vLLM's weight transfer (rollout.weight_sync nccl or gloo)."""
    if weight_transfer:
        return ray.remote(concurrency_groups={CONTROL: 1})(RolloutActor)
    return ray.remote(RolloutActor)


class RolloutActor(RolloutWorker):
    """The RolloutWorker; weights arrive as packed byte arrays from the object store.
    Restarted by Ray, it holds the base model again: where a learner's weights are what
    it should hold (`awaits_weights`), it refuses to generate until it loaded them.
    vLLM's output goes to `engine_log` (rlray.observe.console)."""

    def __init__(
        self,
        *args: Any,
        awaits_weights: bool = True,
        engine_log: str | None = None,
        lends_cores: bool = False,
        **kwargs: Any,
    ):
        """`lends_cores`: the learner on this node may use this worker's cores while it
        does not generate (learner.borrow_idle_cores)."""
        send_engine_output_to(engine_log)  # before vLLM is imported
        super().__init__(*args, **kwargs)
        self.telemetry = Telemetry(self.run_id, self.name)
        self.telemetry.set("rlray_policy_version", self.policy_version)
        self.awaiting_weights = awaits_weights and _restarted()
        cores = max(1, round(self.rollout.cpus_per_worker))
        self.lender = CoreLender(self.run_id, self.name, cores) if lends_cores else None

    def _generating(self) -> contextlib.AbstractContextManager:
        """Holds this worker's cores (none lent) while the block generates."""
        return self.lender.busy() if self.lender else contextlib.nullcontext()

    def _check_weights(self) -> None:
        if self.awaiting_weights:
            raise ActorRestarted(f"{self.name} was restarted and has not loaded weights since")

    def generate(self, rows: list[PromptRow], first_prompt_index: int) -> Any:
        self._check_weights()
        with self._generating():
            return self._counted(*super().generate(rows, first_prompt_index))

    def _counted(self, episodes: list[Episode], stats: GenerateStats) -> Any:
        """Returns a generate call's result, its figures counted for the dashboard."""
        if stats.seconds > 0:
            self.telemetry.set(
                "rlray_rollout_tokens_per_second", stats.completion_tokens / stats.seconds
            )
        self.telemetry.add("rlray_episodes_generated", stats.episodes)
        return episodes, stats

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        self._check_weights()
        with self._generating():
            return super().complete(*args, **kwargs)

    def complete_calls(self, calls: list[ModelCall]) -> list[list[Generated]]:
        self._check_weights()
        with self._generating():
            return super().complete_calls(calls)

    def eval_episodes(
        self, rows: list[PromptRow], samples: int = 0, temperature: float = 1.0, examples: int = 3
    ) -> tuple[EvalEpisodes, EvalResult]:
        self._check_weights()
        with self._generating():
            episodes, result = super().eval_episodes(rows, samples, temperature, examples)
        if result.accuracy is not None:
            self.telemetry.set("rlray_eval_accuracy", result.accuracy)
        return episodes, result

    def token_logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        self._check_weights()  # a restarted engine's would be the base model's
        return super().token_logprobs(episodes)

    def finish_weight_update(self, version: int) -> None:
        super().finish_weight_update(version)
        self.awaiting_weights = False
        self.telemetry.set("rlray_policy_version", self.policy_version)

    def load_published(self, published: tuple[int, PackedWeights]) -> tuple[int, float]:
        """Loads a published (version, weights) pair in place; returns the version now
        held and the seconds it took."""
        # torch loads in the rollout actor only (the driver imports this module)
        from rlray.weights.packing import unpack_weights, weights_for_vllm

        version, packed = published
        architecture = self.llm.model_config.architecture
        weights = weights_for_vllm(unpack_weights(packed), packed.tied_output, architecture)
        seconds = self.load_weights(version, weights)
        self.awaiting_weights = False
        self.telemetry.set("rlray_policy_version", self.policy_version)
        return self.policy_version, seconds


class RewardActor(RewardWorker):
    """The RewardWorker, counting what it scores for the dashboard."""

    def __init__(self, run_id: str, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.telemetry = Telemetry(run_id, self.name)

    def score(self, episodes: list[Episode], step: int = 0) -> tuple[list[Episode], ScoreStats]:
        scored, stats = super().score(episodes, step)
        self.telemetry.add("rlray_episodes_scored", stats.episodes)
        return scored, stats

    def score_and_split(self, episodes: list[Episode], step: int = 0) -> Any:
        kept, uniform, stats = super().score_and_split(episodes, step)
        self.telemetry.add("rlray_uniform_groups_dropped", stats.uniform_groups)
        return kept, uniform, stats


class BufferActor(EpisodeBuffer):
    """The EpisodeBuffer, reporting depth, stale drops and staleness for the dashboard.
    Restarted by Ray, it refuses every call but `restore` until its producer restored it."""

    def __init__(self, run_id: str, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.telemetry = Telemetry(run_id)
        self.telemetry.set("rlray_dropped_stale", 0)
        self.telemetry.set("rlray_buffer_depth", 0)
        self.awaiting_restore = _restarted()

    def _check_restored(self) -> None:
        if self.awaiting_restore:
            raise ActorRestarted("buffer was restarted and has not been restored since")

    def restore(self, batches: list[BufferedBatch], reserved_episodes: int) -> None:
        super().restore(batches, reserved_episodes)
        self.awaiting_restore = False
        self.telemetry.set("rlray_buffer_depth", self.depth_episodes)

    def reserve(self, num_episodes: int) -> bool:
        self._check_restored()
        return super().reserve(num_episodes)

    def stats(self) -> dict[str, int]:
        self._check_restored()
        return super().stats()

    def drain(self) -> list[BufferedBatch]:
        self._check_restored()
        return super().drain()

    def add(self, batch: BufferedBatch, reserved: int | None = None) -> None:
        self._check_restored()
        super().add(batch, reserved)
        self.telemetry.set("rlray_buffer_depth", self.depth_episodes)

    def add_external(self, episodes: list[Episode], policy_version: int) -> None:
        """Adds posted episodes, whose room was reserved, as an external batch; this
        process puts them in the object store, so they outlive the endpoint that
        posted them."""
        batch = BufferedBatch(
            ref=[ray.put(episodes)],
            policy_version=policy_version,
            num_episodes=len(episodes),
            first_prompt_index=-1,
            batch_id=-1,
            external=True,
        )
        self.add(batch)

    def take(self, num_episodes: int, learner_version: int) -> TakenBatches | None:
        self._check_restored()
        taken = super().take(num_episodes, learner_version)
        self.telemetry.set("rlray_dropped_stale", self.dropped_stale_episodes)
        self.telemetry.set("rlray_buffer_depth", self.depth_episodes)
        for batch in taken.batches if taken else []:
            if not batch.external:
                staleness = learner_version - batch.policy_version
                self.telemetry.observe("rlray_staleness", staleness, batch.num_episodes)
        return taken


STORE_CALLS = "store"
"""The concurrency group of a store's calls: one at a time, in a thread of their own, so
that a buffer in the same process (EpisodesActor) answers while a batch is written."""

SCORING_CALLS = "scoring"
"""The concurrency group of the scoring calls of a store that scores (reward.num_workers
0): one at a time, in a thread of their own, beside the store's and the buffer's."""

STORE_GROUPS = {STORE_CALLS: 1, SCORING_CALLS: 1}
"""The concurrency groups to start a StoreActor or EpisodesActor with."""


class StoreActor:
    """The run's EpisodeStore; it fetches episode batches from the object store itself,
    so they never pass through the driver. With `scorer` (RewardActor's arguments after
    run_id), it scores too, as a reward actor would: reward.num_workers 0. Start it with
    `concurrency_groups=STORE_GROUPS`."""

    def __init__(
        self,
        config: StoreConfig,
        run_dir: str,
        run_id: str,
        scorer: tuple | None = None,
        shard: int = 0,
    ):
        self.store = open_store(config, Path(run_dir), run_id, shard)
        self.upload_timeout_s = config.upload_timeout_s
        self.scorer = RewardActor(run_id, *scorer) if scorer else None

    @ray.method(concurrency_group=SCORING_CALLS)
    def score(self, episodes: list[Episode], step: int = 0) -> tuple[list[Episode], ScoreStats]:
        return self._scorer().score(episodes, step)

    @ray.method(concurrency_group=SCORING_CALLS)
    def score_and_split(self, episodes: list[Episode], step: int = 0) -> Any:
        return self._scorer().score_and_split(episodes, step)

    @ray.method(concurrency_group=SCORING_CALLS)
    def evaluate(self, episodes: EvalEpisodes, step: int = 0) -> list[EvalSample]:
        return self._scorer().evaluate(episodes, step)

    def _scorer(self) -> RewardActor:
        if self.scorer is None:
            raise RuntimeError("this store does not score: the run has reward actors")
        return self.scorer

    @ray.method(concurrency_group=STORE_CALLS)
    def append_batches(
        self,
        batch_refs: list[list[Any]],
        trained_at: float | None,
        timeout_s: float,
        key: str | None = None,
    ) -> int:
        """Stores the referenced batches (trained_at None: never trained on) as the append
        `key` (a retry with the same key stores nothing); returns how many episodes were
        added."""
        episodes = mark_trained(resolve_episodes(batch_refs, timeout_s), trained_at)
        return self.store.append(episodes, key)

    @ray.method(concurrency_group=STORE_CALLS)
    def append_episodes(self, episodes: list[Episode], key: str | None = None) -> int:
        """Stores episodes given by value (the ingestion endpoint's); returns the count."""
        return self.store.append(episodes, key)

    @ray.method(concurrency_group=STORE_CALLS)
    def close(self) -> tuple[StoreStats, list[str]]:
        """Writes what is buffered, waits for uploads; returns stats and the files left
        in the upload spool."""
        left = self.store.close(self.upload_timeout_s)
        return self.store.stats(), [str(path) for path in left]

    @ray.method(concurrency_group=STORE_CALLS)
    def store_stats(self) -> StoreStats:
        return self.store.stats()


class EpisodesActor(BufferActor, StoreActor):
    """A training run's buffer and store in one process: both hold only what the driver
    can give back (the buffer its batches' references, the store its journal on disk),
    so one restart restores both (rlray.driver.recovery), and a process of Python, Ray
    and pyarrow, with its memory, is saved. The store's calls run in a thread of their own
    (STORE_CALLS): a learner step's take never waits behind a batch being written; so
    do its scoring calls, if it scores (SCORING_CALLS)."""

    def __init__(
        self,
        run_id: str,
        capacity_episodes: int,
        max_staleness: int,
        store: StoreConfig,
        run_dir: str,
        scorer: tuple | None = None,
    ):
        BufferActor.__init__(self, run_id, capacity_episodes, max_staleness)
        StoreActor.__init__(self, store, run_dir, run_id, scorer)
