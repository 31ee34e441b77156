"""The Ray edge: plain classes become named actors, and every remote wait has a timeout.

Nothing here holds business logic. `RolloutWorker`, `RewardWorker`, `EpisodeBuffer`,
`Learner`, `EpisodeStore` and the ingestion service are the plain classes; this module
starts them, in their roles' placement groups, as actors named `rollout-0`, `reward-0`,
`buffer`, `learner` (`learner-1`, ... beside it in a learner group), `store` and
`ingest`, adds the few methods that need Ray (fetching episode references, recording Ray
metrics), and turns a dead or stuck actor into an `ActorFailure` that names it.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from aiohttp import web
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlray.buffer import BufferedBatch, EpisodeBuffer, TakenBatches
from rlray.checkpoints import checkpoint_version
from rlray.config import Config, IngestConfig, StoreConfig, weight_sync
from rlray.data import PromptRow
from rlray.episode import Episode, ModelLimits
from rlray.evaluation import EvalEpisodes
from rlray.ingest import EXTERNAL_POLICY_VERSION, IngestService, make_app
from rlray.models import load_tokenizer, model_limits, read_as
from rlray.placement import Placement, role_resources
from rlray.rewards import RewardWorker, ScoreStats
from rlray.rollout import EvalResult, RolloutWorker, vllm_env
from rlray.store import StoreStats, mark_trained, open_store
from rlray.telemetry import Telemetry

if TYPE_CHECKING:
    from rlray.weights import PackedWeights
from rlray.step_metrics import StepMetrics


class ActorFailure(RuntimeError):
    """A remote call failed or timed out; the message names the actor and its last error.
    `died` is True when the actor's process (or node) died, False for an error raised by
    the call or a timeout; `actor_id` is the dead actor's id where Ray names it (it can be
    another actor than the one called: the one that made the call's argument)."""

    def __init__(
        self,
        message: str,
        died: bool = False,
        actor_id: str | None = None,
        restarting: bool = False,
        lost: bool = False,
    ):
        super().__init__(message)
        self.died = died
        self.actor_id = actor_id
        self.restarting = restarting
        """Ray is restarting the actor (it answers once it is up again)."""
        self.lost = lost
        """An object the call needed was lost with its node: make it again, then retry."""


class ActorRestarted(RuntimeError):
    """Raised by a restarted actor whose state its caller must restore first (a rollout
    worker's weights, the buffer's batches): a restart between two calls is otherwise
    invisible to the caller."""


def _restarted() -> bool:
    with warnings.catch_warnings():  # Ray's own property reads a deprecated one
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().was_current_actor_reconstructed


def wait_for(ref: Any, actor: str, what: str, timeout_s: float) -> Any:
    """Returns ray.get(ref) within timeout_s, or raises ActorFailure naming the actor."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise ActorFailure(f"{actor}: no answer to {what} within {timeout_s:.0f} s") from None
    except RayTaskError as err:
        message = f"{actor}: {what} failed: {_last_line(err)}"
        if isinstance(err.cause, RayActorError):  # the actor that made an argument died
            raise ActorFailure(message, died=True, actor_id=err.cause.actor_id) from err
        restarted = isinstance(err.cause, ActorRestarted)
        raise ActorFailure(message, died=restarted) from err
    except RayActorError as err:
        message = f"{actor} died during {what}: {_last_line(err)}"
        restarting = isinstance(err, ActorUnavailableError)
        raise ActorFailure(message, True, err.actor_id, restarting) from err
    except ObjectLostError as err:
        message = f"{actor}: {what} lost its input with a node: {_last_line(err)}"
        raise ActorFailure(message, died=True, lost=True) from err


def _last_line(err: Exception) -> str:
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and not isinstance(cause, (RayTaskError, RayActorError)):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def resolve_episodes(batch_refs: Sequence[list[Any]], timeout_s: float) -> list[Episode]:
    """Returns the episodes behind buffered references ([ref] each), fetched here."""
    batches = ray.get([box[0] for box in batch_refs], timeout=timeout_s)
    return [episode for batch in batches for episode in batch]


class _GroupMember:
    """A learner of a group, built in two steps so that the group's rank 0 can name its
    address before any learner joins (`setup`)."""

    rank: int
    world_size: int

    def rendezvous(self) -> tuple[str, int]:
        """Returns this node's address and a free port: rank 0's are the group's."""
        from rlray.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def _join(self, address: str, port: int, device: str, timeout_s: float) -> None:
        """Joins the learner group, when there is more than one learner."""
        if self.world_size > 1:
            from rlray.distributed import join_group

            join_group(self.rank, self.world_size, address, port, device, timeout_s)


class LearnerActor(_GroupMember):
    """The Learner, plus what needs Ray: it resolves episode references itself, so
    episode data goes object store -> learner and never through the driver. It holds the
    Learner rather than being one so that this module, which every actor and the driver
    import, does not import torch (~140 MB of private memory in each process).

    One of `world_size` learners: its models are sharded across the group."""

    def __init__(self, run_id: str, rank: int, world_size: int, *args: Any, **kwargs: Any):
        self.rank, self.world_size = rank, world_size
        self.learner_args, self.learner_kwargs = args, kwargs
        self.telemetry = Telemetry(run_id, "learner" if rank == 0 else f"learner-{rank}")

    def setup(self, address: str, port: int, timeout_s: float) -> None:
        """Joins the learner group, then builds the Learner."""
        from rlray.learner import Learner

        self._join(address, port, self.learner_kwargs.get("device", "cpu"), timeout_s)
        self.learner = Learner(*self.learner_args, **self.learner_kwargs)

    def train_on(self, batch_refs: list[list[Any]], timeout_s: float) -> StepMetrics:
        """Fetches the referenced episode batches and runs one learner step on them."""
        metrics = self.learner.train_step(resolve_episodes(batch_refs, timeout_s))
        self.telemetry.set("rlray_reward_mean", metrics.reward_mean)
        self.telemetry.set("rlray_learner_step_seconds", metrics.learner_seconds)
        self.telemetry.set("rlray_logprob_parity_error", metrics.logprob_parity_error)
        self.telemetry.set("rlray_rollout_logprob_diff_mean", metrics.rollout_logprob_diff_mean)
        self.telemetry.set("rlray_policy_version", metrics.policy_version)
        return metrics

    def publish_weights(self) -> tuple[int, PackedWeights]:
        """Returns (version, weights) packed as byte arrays. Returned from an actor method,
        they are stored once in the object store, owned by the caller; rollout workers on
        the same node then read the arrays without a copy."""
        from rlray.weights import pack_weights

        weights = pack_weights(self.learner.published_weights(), self.learner.tied_output)
        return self.learner.version, weights

    def open_weight_transfer(
        self,
        backend: str,
        address: str,
        port: int,
        workers: list[tuple[str, Any]],
        ranks_per_worker: int,
        timeout_s: float,
    ) -> None:
        """Opens vLLM's weight transfer to the named rollout workers (rlray.weight_transfer);
        every learner of a group opens it, rank 0's address and port are the group's."""
        from rlray.weight_transfer import RolloutClient

        # A tied output embedding is sent under its own name only where vLLM's model takes
        # it, which a worker tells. Rank 0 alone asks (the others' stream is not sent):
        # a worker's answer waits behind its update_weights, which waits on the gathers.
        tied = self.learner.tied_output if self.rank == 0 else None
        if tied is not None:
            name, first = workers[0]
            if not wait_for(first.loads_tied_output.remote(tied), name, "tied check", timeout_s):
                tied = None
        client = RolloutClient(workers, timeout_s, ranks_per_worker)
        world_size = 1 + len(workers) * ranks_per_worker
        self.learner.open_weight_transfer(
            backend, client, address, port, world_size, tied, timeout_s
        )

    def send_weights(self) -> int:
        """Sends the current weights through the open transfer; returns their version."""
        return self.learner.send_weights()

    def close_weight_transfer(self) -> None:
        self.learner.close_weight_transfer()

    def check_parity(self, episodes: list[Episode]) -> float | None:
        return self.learner.check_parity(episodes)

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        return self.learner.logprobs(episodes)

    def save_checkpoint(self, run_dir: str, prompt_cursor: int) -> Path:
        return self.learner.save_checkpoint(run_dir, prompt_cursor)

    def state(self) -> dict[str, Any]:
        return self.learner.state()


class PreferenceActor(_GroupMember):
    """A PreferenceLearner (rlray/dpo.py) in jobs/dpo.py's learner group: it builds each
    step's pairs itself, so the driver sends only step numbers."""

    def __init__(
        self, rank: int, world_size: int, config: Config, model_path: str, run_id: str, device: str
    ):
        self.rank, self.world_size = rank, world_size
        self.config, self.model_path, self.run_id, self.device = config, model_path, run_id, device

    def setup(self, address: str, port: int, timeout_s: float) -> None:
        """Joins the learner group, then builds the PreferenceLearner."""
        from rlray.dpo import PreferenceLearner

        self._join(address, port, self.device, timeout_s)
        self.learner = PreferenceLearner(self.config, self.model_path, self.run_id, self.device)

    def step(self, step: int) -> dict[str, float]:
        return self.learner.step(step)

    def evaluate(self, step: int) -> dict[str, float]:
        return self.learner.evaluate(step)

    def publish_weights(self, step: int) -> tuple[int, PackedWeights | None]:
        return self.learner.publish_weights(step)

    def save_checkpoint(self, run_dir: str, step: int) -> None:
        self.learner.save_checkpoint(run_dir, step)


class RolloutActor(RolloutWorker):
    """The RolloutWorker; weights arrive as packed byte arrays from the object store."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.telemetry = Telemetry(self.run_id, self.name)
        self.telemetry.set("rlray_policy_version", self.policy_version)
        self.awaiting_weights = _restarted()  # restarted by Ray: holds the base model

    def _check_weights(self) -> None:
        if self.awaiting_weights:
            raise ActorRestarted(f"{self.name} was restarted and has not loaded weights since")

    def generate(self, rows: list[PromptRow], first_prompt_index: int) -> Any:
        self._check_weights()
        episodes, stats = super().generate(rows, first_prompt_index)
        self.telemetry.set(
            "rlray_rollout_tokens_per_second", stats.completion_tokens / stats.seconds
        )
        self.telemetry.add("rlray_episodes_generated", stats.episodes)
        return episodes, stats

    def eval_episodes(
        self, rows: list[PromptRow], samples: int = 0, temperature: float = 1.0, examples: int = 3
    ) -> tuple[EvalEpisodes, EvalResult]:
        self._check_weights()
        episodes, result = super().eval_episodes(rows, samples, temperature, examples)
        if result.accuracy is not None:
            self.telemetry.set("rlray_eval_accuracy", result.accuracy)
        return episodes, result

    def finish_weight_update(self, version: int) -> None:
        super().finish_weight_update(version)
        self.awaiting_weights = False
        self.telemetry.set("rlray_policy_version", self.policy_version)

    def load_published(self, published: tuple[int, PackedWeights]) -> tuple[int, float]:
        """Loads a published (version, weights) pair in place; returns the version now
        held and the seconds it took."""
        from rlray.weights import unpack_weights, weights_for_vllm

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


class LearnerGroup:
    """The learner actors of a run, called as one: `group.method.remote(...)` calls the
    method on every learner (each takes part in the group's collectives) and returns
    rank 0's result. A learner that fails fails rank 0's call too: its collectives lose
    their peer."""

    def __init__(self, handles: list[Any]):
        self.handles = handles

    @property
    def names(self) -> list[str]:
        return learner_names(len(self.handles))

    def __getattr__(self, method: str) -> _GroupCall:
        # Actor methods only: pickling (Actors goes to the ingest actor) asks a bare
        # instance for __setstate__ and the like before `handles` exists.
        if method.startswith("_") or "handles" not in self.__dict__:
            raise AttributeError(method)
        return _GroupCall([getattr(handle, method) for handle in self.handles])


def learner_names(count: int) -> list[str]:
    """Returns the names of a group's learner actors: rank 0 is `learner`."""
    return [f"learner-{rank}" if rank else "learner" for rank in range(count)]


class _GroupCall:
    def __init__(self, methods: list[Any]):
        self.methods = methods

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        refs = [method.remote(*args, **kwargs) for method in self.methods]
        return refs[0]


@dataclass
class Actors:
    """Handles of one run's actors, by role, with their names. A collect-only run has no
    buffer and no learner."""

    rollout: list[Any]
    rollout_names: list[str]
    reward: list[Any]
    reward_names: list[str]
    store: Any
    buffer: Any = None
    learner: LearnerGroup | None = None
    ingest: Any = None
    placement: Placement | None = None

    def handle(self, name: str) -> Any:
        """Returns the handle of the actor called `name`."""
        return dict(self.all())[name]

    def name_of(self, actor_id: str | None) -> str | None:
        """Returns the name of the actor with this (hex) id, None if not one of ours."""
        ids = {handle._actor_id.hex(): name for name, handle in self.all()}
        return ids.get(actor_id) if actor_id else None

    def all(self) -> list[tuple[str, Any]]:
        """Returns (name, handle) of every actor."""
        singles = [("store", self.store), ("buffer", self.buffer), ("ingest", self.ingest)]
        learners = self.learner or LearnerGroup([])
        return [
            *zip(self.rollout_names, self.rollout, strict=True),
            *zip(self.reward_names, self.reward, strict=True),
            *((name, handle) for name, handle in singles if handle is not None),
            *zip(learners.names, learners.handles, strict=True),
        ]

    def kill(self) -> None:
        """Stops every actor (their names become free for the next run) and gives their
        placement groups back."""
        for _, handle in self.all():
            ray.kill(handle, no_restart=True)
        if self.placement is not None:
            self.placement.release()
        _wait_until_names_free([name for name, _ in self.all()], timeout_s=60)


def _wait_until_names_free(names: list[str], timeout_s: float) -> None:
    """Waits until killed actors' names can be taken again (a run that resumes in the
    same job starts actors with the same names)."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            time.sleep(0.2)


class StoreActor:
    """The run's EpisodeStore in its own process; it fetches episode batches from the
    object store itself, so they never pass through the driver."""

    def __init__(self, config: StoreConfig, run_dir: str, run_id: str):
        self.store = open_store(config, Path(run_dir), run_id)
        self.upload_timeout_s = config.upload_timeout_s

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

    def append_episodes(self, episodes: list[Episode], key: str | None = None) -> int:
        """Stores episodes given by value (the ingestion endpoint's); returns the count."""
        return self.store.append(episodes, key)

    def close(self) -> tuple[StoreStats, list[str]]:
        """Writes what is buffered, waits for uploads; returns stats and the files left
        in the upload spool."""
        left = self.store.close(self.upload_timeout_s)
        return self.store.stats(), [str(path) for path in left]

    def stats(self) -> StoreStats:
        return self.store.stats()


def connect(address: str, num_cpus: int) -> None:
    """Joins the cluster in `address` or RAY_ADDRESS (set by `ray job submit`), else
    starts a new single-node Ray for this job, even if a `ray start` cluster runs here."""
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS", "")
    if target:
        _send_auth_token_if_any()
        ray.init(address=target)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)


def _send_auth_token_if_any() -> None:
    # `ray start` turns token authentication on when ~/.ray/auth_token exists, but a
    # client joining with ray.init(address=...) sends the token only in token mode
    # (Ray 2.60): without this, joining fails with "InvalidAuthToken". This is what
    # `ray start` itself calls; it also refreshes Ray's cached config.
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def required_cpus(config: Config) -> float:
    """Returns the logical CPUs the run's actors reserve."""
    return (
        config.rollout.num_workers * config.rollout.cpus_per_worker
        + config.reward.num_workers * config.reward.cpus_per_worker
        + config.learner.num_workers * config.learner.cpus
    )


def start_actors(
    config: Config,
    model_path: str,
    run_id: str,
    checkpoint: str | None = None,
    train: bool = True,
) -> Actors:
    """Reserves each role's placement group, starts a run's actors in them (without
    buffer and learner when not `train`) and waits, with a timeout, until each is up."""
    timeout = config.ray.actor_start_timeout_s
    placement = Placement(run_id)
    roles = role_resources(config)
    for role in ("rollout", "reward", "learner") if train else ("rollout", "reward"):
        problem = placement.reserve(roles[role], timeout)
        if problem:
            placement.release()
            raise ActorFailure(problem)
    rollout_names = [f"rollout-{i}" for i in range(config.rollout.num_workers)]
    reward_names = [f"reward-{i}" for i in range(config.reward.num_workers)]
    actors = Actors(
        rollout=_start_rollout_workers(
            config, rollout_names, model_path, run_id, checkpoint, placement
        ),
        rollout_names=rollout_names,
        reward=[
            _start_reward_worker(config, name, run_id, placement.actor_options("reward", i))
            for i, name in enumerate(reward_names)
        ],
        reward_names=reward_names,
        store=ray.remote(StoreActor)
        .options(
            name="store",
            num_cpus=0,
            max_restarts=config.ray.max_actor_restarts,
            # Beside the driver: it writes into the run directory (the driver's disk),
            # and a restarted store must find its journal there.
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        .remote(config.store, config.run_dir, run_id),
        placement=placement,
    )
    if train:
        actors.buffer = (
            ray.remote(BufferActor)
            .options(name="buffer", num_cpus=0, max_restarts=config.ray.max_actor_restarts)
            .remote(run_id, config.buffer.capacity_episodes, config.buffer.max_staleness)
        )
        actors.learner = _start_learners(config, model_path, run_id, checkpoint, placement)
    try:
        for name, handle in actors.all():
            wait_for(handle.__ray_ready__.remote(), name, "start-up", timeout)
        if actors.learner is not None:
            _set_up_learners(actors.learner, timeout)
    except ActorFailure:
        actors.kill()
        raise
    return actors


def _start_rollout_workers(
    config: Config,
    names: list[str],
    model_path: str,
    run_id: str,
    checkpoint: str | None,
    placement: Placement,
) -> list[Any]:
    # Rollout workers start from the run's base model; a resumed run's checkpoint weights
    # reach them with the first weight sync, so the checkpoint need not be on their node.
    rollout_model = _model_for_actors(config, model_path)
    version = checkpoint_version(checkpoint) if checkpoint else 0
    env = {"env_vars": vllm_env(config.rollout)}
    rollout = replace(config.rollout, weight_sync=weight_sync(config))
    return [
        ray.remote(RolloutActor)
        .options(
            name=name,
            runtime_env=env,
            max_restarts=config.ray.max_actor_restarts,
            **placement.actor_options("rollout", i),
        )
        .remote(name, rollout_model, config.model, rollout, run_id, config.seed + i, version)
        for i, name in enumerate(names)
    ]


def _start_reward_worker(config: Config, name: str, run_id: str, options: dict) -> Any:
    reward = config.reward
    return (
        ray.remote(RewardActor)
        .options(name=name, max_restarts=config.ray.max_actor_restarts, **options)
        .remote(
            run_id,
            name,
            reward.functions,
            reward.on_failure,
            reward.batch_size,
            eval_specs=config.eval.rewards,
        )
    )


def _start_learners(
    config: Config, model_path: str, run_id: str, checkpoint: str | None, placement: Placement
) -> LearnerGroup:
    device = "cuda" if config.learner.gpus > 0 else "cpu"
    count = config.learner.num_workers
    group = LearnerGroup([])
    for rank, name in enumerate(learner_names(count)):
        handle = (
            ray.remote(LearnerActor)
            .options(name=name, **placement.actor_options("learner", rank))
            .remote(
                run_id,
                rank,
                count,
                _model_for_actors(config, model_path),
                config.model,
                config.algorithm,
                config.learner,
                max_new_tokens=config.completion_budget,
                samples_per_prompt=config.rollout.samples_per_prompt,
                temperature=config.rollout.temperature,
                seed=config.seed,
                device=device,
                checkpoint=checkpoint,
            )
        )
        group.handles.append(handle)
    return group


def start_preference_learners(
    config: Config, model_path: str, run_id: str, evaluator: bool
) -> tuple[LearnerGroup, Any, Placement]:
    """Reserves placement for jobs/dpo.py's learner group (and, if `evaluator`, one
    rollout actor, `eval`, for its greedy evaluations), starts them and waits, with a
    timeout, until each learner has joined the group and built its models; returns the
    group, the evaluation actor (or None) and the placement."""
    timeout = config.ray.actor_start_timeout_s
    placement = Placement(run_id)
    roles = role_resources(config)
    wanted = [roles["learner"]] + ([replace(roles["rollout"], count=1)] if evaluator else [])
    for resources in wanted:
        problem = placement.reserve(resources, timeout)
        if problem:
            placement.release()
            raise ActorFailure(problem)
    device = "cuda" if config.learner.gpus > 0 else "cpu"
    count, model = config.learner.num_workers, _model_for_actors(config, model_path)
    group = LearnerGroup(
        [
            ray.remote(PreferenceActor)
            .options(name=name, **placement.actor_options("learner", rank))
            .remote(rank, count, config, model, run_id, device)
            for rank, name in enumerate(learner_names(count))
        ]
    )
    evaluation = None
    if evaluator:
        names = ["eval"]
        (evaluation,) = _start_rollout_workers(config, names, model_path, run_id, None, placement)
    _set_up_learners(group, timeout)
    return group, evaluation, placement


def _set_up_learners(group: LearnerGroup, timeout_s: float) -> None:
    """Has every learner join the group at rank 0's address and build its Learner."""
    address, port = wait_for(group.handles[0].rendezvous.remote(), "learner", "start-up", timeout_s)
    refs = [handle.setup.remote(address, port, timeout_s) for handle in group.handles]
    for name, ref in zip(group.names, refs, strict=True):
        wait_for(ref, name, "start-up", timeout_s)


def _model_for_actors(config: Config, model_path: str) -> str:
    """Returns the model actors load: a built-in one by name (each node builds or finds
    it in its own cache), any other by the path or hub name the driver checked."""
    return config.model.path if config.model.path.startswith("builtin:") else model_path


def actor_processes(actors: Actors, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Returns {actor name: {"node": node id, "pid": process id}} (what placement.json
    records: where each actor runs, and which process to look at, or kill in a test)."""

    def process_of(_: Any) -> dict[str, Any]:
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    refs = {name: handle.__ray_call__.remote(process_of) for name, handle in actors.all()}
    return {name: wait_for(ref, name, "process lookup", timeout_s) for name, ref in refs.items()}


def local_pids(processes: dict[str, dict[str, Any]]) -> list[int]:
    """Returns the process ids of the actors that run on the caller's node."""
    here = ray.get_runtime_context().get_node_id()
    return [p["pid"] for p in processes.values() if p["node"] == here]


class IngestActor:
    """The ingestion endpoint (rlray.ingest) in its own async actor: posted episodes are
    scored by the run's reward actors, stored by its store and, with ingest.train,
    queued in its buffer."""

    def __init__(
        self,
        config: IngestConfig,
        token: str,
        model_path: str,
        actors: Actors,
        limits: ModelLimits | None = None,
    ):
        self.config = config
        self.actors = actors
        self.step = 0
        self.next_reward = 0
        self.tokenizer = load_tokenizer(model_path) if config.train else None
        self.warned_lost_characters = False
        enqueue = self._enqueue if config.train and actors.buffer is not None else None
        tokenize = self._tokenize if config.train else None
        self.service = IngestService(token, self._score, self._store, enqueue, limits, tokenize)

    async def start(self) -> str:
        """Starts serving; returns the endpoint's URL."""
        app = make_app(self.service, self.config.max_body_bytes)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.config.host, self.config.port).start()
        return f"http://{self.config.host}:{self.config.port}/v1/episodes"

    def set_step(self, step: int) -> None:
        """The learner step whose reward weights score posted episodes."""
        self.step = step

    async def _score(self, episodes: list[Episode]) -> list[Episode]:
        reward = self.actors.reward[self.next_reward % len(self.actors.reward)]
        self.next_reward += 1
        scored, _ = await reward.score.remote(episodes, self.step)
        return scored

    async def _store(self, episodes: list[Episode]) -> None:
        await self.actors.store.append_episodes.remote(episodes)

    def _tokenize(self, episodes: list[Episode]) -> None:
        """Gives episodes posted without token ids the model's (checked against the
        model's limits next); the first prompt that loses characters is logged, once."""
        for episode in episodes:
            if not episode.prompt_token_ids or not episode.completion_token_ids:
                episode.prompt_token_ids = self.tokenizer(episode.prompt).input_ids
                completion = self.tokenizer(episode.completion).input_ids
                episode.completion_token_ids = [*completion, self.tokenizer.eos_token_id]
                episode.rollout_logprobs = []  # unknown: the learner uses its own
                lost = read_as(self.tokenizer, episode.prompt, episode.prompt_token_ids)
                if lost is not None and not self.warned_lost_characters:
                    self.warned_lost_characters = True
                    logging.getLogger(__name__).warning(
                        "ingest: posted prompts lose characters to the model's tokenizer, "
                        "e.g. %r (episode %s) reads as %r",
                        episode.prompt[:40],
                        episode.episode_id,
                        lost[:40],
                    )

    async def _enqueue(self, episodes: list[Episode]) -> set[str]:
        """Queues posted episodes for training if the buffer has room; returns their ids."""
        trainable = [e for e in episodes if e.reward is not None]
        if not trainable or not await self.actors.buffer.reserve.remote(len(trainable)):
            return set()
        batch = BufferedBatch(
            ref=[ray.put(trainable)],
            policy_version=EXTERNAL_POLICY_VERSION,
            num_episodes=len(trainable),
            first_prompt_index=-1,
            batch_id=-1,
            external=True,
        )
        await self.actors.buffer.add.remote(batch)
        return {e.episode_id for e in trainable}


def start_ingest(config: Config, actors: Actors, model_path: str, timeout_s: float) -> str:
    """Starts the ingestion endpoint as the `ingest` actor; returns its URL."""
    token = config.ingest.token or os.environ.get("RLRAY_INGEST_TOKEN", "")
    limits = model_limits(model_path, config.model.max_model_len)  # checked in plan_run
    actors.ingest = (
        ray.remote(IngestActor)
        .options(name="ingest", num_cpus=0, max_concurrency=64)
        .remote(config.ingest, token, model_path, actors, limits)
    )
    return wait_for(actors.ingest.start.remote(), "ingest", "start-up", timeout_s)
