"""The Ray faces of the rollout, reward, buffer, store, ingestion and agent roles.

`RolloutWorker`, `RewardWorker`, `EpisodeBuffer`, `EpisodeStore` and the ingestion
service are plain classes; each face here adds only what needs Ray: fetching episode
references from the object store, Ray metrics for the dashboard, and refusing calls
after a restart until the caller restored what the actor held. rlray.cluster.start
starts them as named actors; the learners' faces are in rlray.cluster.learners.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rlray.agent.gateway import AgentGateway, CallLimits, EndpointBusy
from rlray.agent.openai_api import Sampling
from rlray.cluster.calls import ActorRestarted, _restarted, resolve_episodes
from rlray.cluster.serving import EndpointUnavailable, ThreadedServer, remote_result
from rlray.cluster.telemetry import Telemetry
from rlray.config import AgentConfig, IngestConfig, StoreConfig
from rlray.core.episode import Episode, ModelLimits
from rlray.core.evaluation import EvalEpisodes
from rlray.core.prompt import PromptRow
from rlray.core.stats import EvalResult, GenerateStats, ScoreStats, StoreStats
from rlray.data.models import load_tokenizer
from rlray.episodes.buffer import BufferedBatch, EpisodeBuffer, TakenBatches
from rlray.episodes.ingest import (
    EXTERNAL_POLICY_VERSION,
    IngestError,
    IngestService,
    TokenIds,
    make_app,
    store_key,
)
from rlray.episodes.store import mark_trained, open_store
from rlray.observe.console import send_engine_output_to
from rlray.rewards.worker import RewardWorker
from rlray.rollout.sampling import Generated
from rlray.rollout.worker import RolloutWorker

if TYPE_CHECKING:
    from rlray.weights.packing import PackedWeights


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
        **kwargs: Any,
    ):
        send_engine_output_to(engine_log)  # before vLLM is imported
        super().__init__(*args, **kwargs)
        self.telemetry = Telemetry(self.run_id, self.name)
        self.telemetry.set("rlray_policy_version", self.policy_version)
        self.awaiting_weights = awaits_weights and _restarted()

    def _check_weights(self) -> None:
        if self.awaiting_weights:
            raise ActorRestarted(f"{self.name} was restarted and has not loaded weights since")

    def generate(self, rows: list[PromptRow], first_prompt_index: int) -> Any:
        self._check_weights()
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
        return super().complete(*args, **kwargs)

    def eval_episodes(
        self, rows: list[PromptRow], samples: int = 0, temperature: float = 1.0, examples: int = 3
    ) -> tuple[EvalEpisodes, EvalResult]:
        self._check_weights()
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


class StoreActor:
    """The run's EpisodeStore; it fetches episode batches from the object store itself,
    so they never pass through the driver. Start it with
    `concurrency_groups={STORE_CALLS: 1}`."""

    def __init__(self, config: StoreConfig, run_dir: str, run_id: str):
        self.store = open_store(config, Path(run_dir), run_id)
        self.upload_timeout_s = config.upload_timeout_s

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
    and pyarrow (about 0.09 GiB) is saved. The store's calls run in a thread of their own
    (STORE_CALLS): a learner step's take never waits behind a batch being written."""

    def __init__(
        self,
        run_id: str,
        capacity_episodes: int,
        max_staleness: int,
        store: StoreConfig,
        run_dir: str,
    ):
        BufferActor.__init__(self, run_id, capacity_episodes, max_staleness)
        StoreActor.__init__(self, store, run_dir, run_id)


class IngestActor:
    """The ingestion endpoint (rlray.episodes.ingest) as an endpoint actor
    (rlray.cluster.serving): it serves from its constructor, so Ray's restart of it
    serves again on the same host and port. Posted episodes are scored by the run's
    reward actors, stored by its store (a keyed append) and, with ingest.train, queued
    in its buffer; accepted ids go to a ledger in the run directory, which a restarted
    endpoint reads back."""

    def __init__(
        self,
        config: IngestConfig,
        token: str,
        model_path: str,
        rewards: list[Any],
        store: Any,
        buffer: Any = None,
        limits: ModelLimits | None = None,
        ledger: str | None = None,
    ):
        self.config = config
        self.rewards, self.store, self.buffer = rewards, store, buffer
        self.step = 0
        self.next_reward = 0
        enqueue = self._enqueue if config.train and buffer is not None else None
        # Posted episodes are trained on with their token ids: those must be the text's.
        tokens = TokenIds(load_tokenizer(model_path)) if config.train else None
        self.service = IngestService(
            token,
            self._score,
            self._store,
            enqueue,
            limits,
            tokens,
            Path(ledger) if ledger else None,
            tokens.check_texts if tokens else None,
        )
        app = make_app(self.service, config.max_body_bytes)
        self.server = ThreadedServer(app, config.host, config.port)

    def url(self) -> str:
        """Returns the endpoint's URL (it serves from the constructor on)."""
        return f"{self.server.url}/v1/episodes"

    def set_step(self, step: int) -> None:
        """The learner step: its reward weights score posted episodes, and its policy
        version is the newest a posted episode may claim."""
        self.step = step
        self.service.policy_version = step

    async def _score(self, episodes: list[Episode]) -> list[Episode]:
        reward = self.rewards[self.next_reward % len(self.rewards)]
        self.next_reward += 1
        scored, _ = await _needed(reward.score.remote(episodes, self.step))
        return scored

    async def _store(self, episodes: list[Episode]) -> None:
        await _needed(self.store.append_episodes.remote(episodes, store_key(episodes)))

    async def _enqueue(self, episodes: list[Episode]) -> set[str]:
        """Queues posted episodes for training if the buffer has room; returns their ids.
        The buffer actor puts them in the object store: they are its, not this
        endpoint's, and outlive this endpoint's process."""
        trainable = [e for e in episodes if e.reward is not None]
        if not trainable or not await _needed(self.buffer.reserve.remote(len(trainable))):
            return set()
        await _needed(self.buffer.add_external.remote(trainable, EXTERNAL_POLICY_VERSION))
        return {e.episode_id for e in trainable}


async def _needed(ref: Any) -> Any:
    """Returns the result of a call the endpoint needs; a dead or restarting actor
    answers the client 503."""
    try:
        return await remote_result(ref)
    except EndpointUnavailable as err:
        raise IngestError(503, f"{err}; retry") from None


class AgentActor:
    """The agent endpoint (rlray.agent.gateway) as an endpoint actor
    (rlray.cluster.serving): it hands out a batch's tasks, serves their model calls on
    the batch's rollout worker (`RolloutWorker.complete`) and returns the traces'
    episodes, which go from here to a reward actor through the object store. Traces in
    progress live in this process: if it dies, their batches are made again."""

    def __init__(
        self,
        config: AgentConfig,
        token: str,
        model_path: str,
        worker_names: list[str],
        limits: CallLimits,
        run_id: str,
    ):
        # The rollout actors by name, not handles passed in: Ray keeps an actor's handle
        # arguments in the object store, which a restart could not count on.
        self.workers = [ray.get_actor(name) for name in worker_names]
        self.gateway = AgentGateway(
            token,
            load_tokenizer(model_path),
            limits,
            self._generate,
            run_id,
            worker_names,
            config.trace_timeout_s,
            config.task_wait_s,
            config.max_concurrent_calls,
        )
        app = self.gateway.app(config.max_body_bytes)
        self.server = ThreadedServer(app, config.host, config.port)
        host = self.server.host
        if host in ("0.0.0.0", "::"):  # every address: agents reach this node's
            host = ray.util.get_node_ip_address()
        self.gateway.url = f"http://{host}:{self.server.port}"

    def url(self) -> str:
        """Returns the endpoint's URL (it serves from the constructor on)."""
        return self.gateway.url

    def run_batch(
        self, rows: list[PromptRow], first_prompt_index: int, samples: int, worker: int
    ) -> tuple[list[Episode], GenerateStats]:
        """Hands out one trace per row and sample; returns their episodes once every
        trace ended or was dropped (AgentGateway.run_batch)."""
        batch = self.gateway.run_batch(rows, first_prompt_index, samples, worker)
        return asyncio.run_coroutine_threadsafe(batch, self.server.loop).result()

    def close(self, timeout_s: float = 10.0) -> None:
        """The run needs no more traces: agents asking for one get 204 (those waiting
        for one have, when this returns)."""
        closed = asyncio.run_coroutine_threadsafe(self.gateway.close(timeout_s), self.server.loop)
        closed.result(timeout_s + 5)

    async def _generate(
        self, worker: int, token_ids: list[int], sampling: Sampling, max_tokens: int
    ) -> list[Generated]:
        call = self.workers[worker].complete.remote(
            token_ids,
            sampling.n,
            sampling.temperature,
            max_tokens,
            list(sampling.stop),
            sampling.logprobs,
        )
        try:
            return await remote_result(call)
        except EndpointUnavailable as err:
            raise EndpointBusy(str(err)) from None
