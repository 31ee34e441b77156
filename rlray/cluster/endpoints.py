"""The Ray faces of the run's HTTP endpoints: ingestion (`POST /v1/episodes`,
rlray.episodes.ingest) and the agent endpoint (rlray.agent.gateway).

Each is an endpoint actor (rlray.cluster.serving) that serves from its constructor, so
Ray's restart of it serves again on the same host and port. They live apart from the
other roles' faces (rlray.cluster.roles) so that no other actor imports aiohttp and the
gateway for them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray

from rlray.agent.gateway import AgentGateway, CallLimits, EndpointBusy
from rlray.agent.openai_api import Sampling
from rlray.cluster.serving import (
    EndpointUnavailable,
    JoinedCalls,
    ThreadedServer,
    remote_result,
)
from rlray.config import AgentConfig, IngestConfig
from rlray.core.episode import Episode, ModelLimits
from rlray.core.prompt import PromptRow
from rlray.core.stats import GenerateStats
from rlray.data.models import load_tokenizer
from rlray.episodes.ingest import (
    EXTERNAL_POLICY_VERSION,
    IngestError,
    IngestService,
    TokenIds,
    make_app,
    store_key,
)
from rlray.rollout.sampling import Generated, ModelCall


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
        self.joined = JoinedCalls(self._complete_calls)
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

    # The actor is an async actor (it has coroutine methods): Ray runs its calls in one
    # event loop, so a call that blocked would hold every other one, close() behind a
    # batch waiting for its traces. Each awaits the server's loop instead.

    async def run_batch(
        self, rows: list[PromptRow], first_prompt_index: int, samples: int, worker: int
    ) -> tuple[list[Episode], GenerateStats]:
        """Hands out one trace per row and sample; returns their episodes once every
        trace ended or was dropped (AgentGateway.run_batch)."""
        batch = self.gateway.run_batch(rows, first_prompt_index, samples, worker)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(batch, self.server.loop))

    async def close(self, timeout_s: float = 10.0) -> None:
        """The run needs no more traces: agents asking for one get 204 (those waiting
        for one have, when this returns), and the traces not ended are dropped."""
        closed = asyncio.run_coroutine_threadsafe(self.gateway.close(timeout_s), self.server.loop)
        await asyncio.wait_for(asyncio.wrap_future(closed), timeout_s + 5)

    async def _generate(
        self, worker: int, token_ids: list[int], sampling: Sampling, max_tokens: int
    ) -> list[Generated]:
        call = ModelCall(
            token_ids,
            sampling.n,
            sampling.temperature,
            max_tokens,
            list(sampling.stop),
            sampling.logprobs,
        )
        return await self.joined.call(worker, call)

    async def _complete_calls(self, worker: int, calls: list[ModelCall]) -> list[list[Generated]]:
        """Samples the calls on the worker in one actor call (JoinedCalls)."""
        try:
            return await remote_result(self.workers[worker].complete_calls.remote(calls))
        except EndpointUnavailable as err:
            raise EndpointBusy(str(err)) from None
