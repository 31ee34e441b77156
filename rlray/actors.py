"""The Ray edge: plain classes become named actors, and every remote wait has a timeout.

Nothing here holds business logic. `RolloutWorker`, `RewardWorker`, `EpisodeBuffer` and
`Learner` are the plain classes; this module starts them as actors named `rollout-0`,
`reward-0`, `buffer` and `learner`, adds the few methods that need Ray (the learner
resolving episode references itself), and turns a dead or stuck actor into an
`ActorFailure` that names it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rlray.buffer import EpisodeBuffer
from rlray.config import Config
from rlray.episode import Episode
from rlray.learner import Learner, StepMetrics, checkpoint_version
from rlray.rewards import RewardWorker
from rlray.rollout import RolloutWorker, vllm_env


class ActorFailure(RuntimeError):
    """A remote call failed or timed out; the message names the actor and its last error."""


def wait_for(ref: Any, actor: str, what: str, timeout_s: float) -> Any:
    """Returns ray.get(ref) within timeout_s, or raises ActorFailure naming the actor."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise ActorFailure(f"{actor}: no answer to {what} within {timeout_s:.0f} s") from None
    except RayTaskError as err:
        raise ActorFailure(f"{actor}: {what} failed: {_last_line(err)}") from err
    except RayActorError as err:
        raise ActorFailure(f"{actor} died during {what}: {_last_line(err)}") from err


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


class LearnerActor(Learner):
    """The Learner, plus what needs Ray: it resolves episode references itself, so
    episode data goes object store -> learner and never through the driver."""

    def train_on(self, batch_refs: list[list[Any]], timeout_s: float) -> StepMetrics:
        """Fetches the referenced episode batches and runs one PPO step on them."""
        return self.train_step(resolve_episodes(batch_refs, timeout_s))

    def publish_weights(self) -> tuple[int, dict[str, np.ndarray]]:
        """Returns (version, weights) as numpy arrays. Returned from an actor method, the
        dict is stored once in the object store, owned by the caller; rollout workers on
        the same node then read the arrays without a copy."""
        return self.version, {name: t.numpy() for name, t in self.policy_weights().items()}


class RolloutActor(RolloutWorker):
    """The RolloutWorker; weights arrive as numpy arrays from the object store."""

    def load_published(self, published: tuple[int, dict[str, np.ndarray]]) -> float:
        """Loads a published (version, weights) pair in place; returns seconds taken."""
        version, arrays = published
        with warnings.catch_warnings():
            # The object store hands out read-only arrays and torch warns about sharing
            # them; vLLM only reads them (it copies into its own parameters).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            weights = {name: torch.from_numpy(a) for name, a in arrays.items()}
        return self.load_weights(version, weights)


@dataclass
class Actors:
    """Handles of one run's actors, by role, with their names."""

    rollout: list[Any]
    rollout_names: list[str]
    reward: list[Any]
    reward_names: list[str]
    buffer: Any
    learner: Any

    def all(self) -> list[tuple[str, Any]]:
        """Returns (name, handle) of every actor."""
        return [
            *zip(self.rollout_names, self.rollout, strict=True),
            *zip(self.reward_names, self.reward, strict=True),
            ("buffer", self.buffer),
            ("learner", self.learner),
        ]

    def kill(self) -> None:
        """Stops every actor (their names become free for the next run)."""
        for _, handle in self.all():
            ray.kill(handle, no_restart=True)


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
        + config.learner.cpus
    )


def start_actors(config: Config, model_path: str, run_id: str, checkpoint: str | None) -> Actors:
    """Starts every actor of a run and waits (with a timeout) until each is up."""
    rollout_model = f"{checkpoint}/policy" if checkpoint else model_path
    version = checkpoint_version(checkpoint) if checkpoint else 0
    env = {"env_vars": vllm_env(config.rollout)}
    rollout_names = [f"rollout-{i}" for i in range(config.rollout.num_workers)]
    rollout = [
        ray.remote(RolloutActor)
        .options(
            name=name,
            num_cpus=config.rollout.cpus_per_worker,
            num_gpus=config.rollout.gpus_per_worker,
            runtime_env=env,
        )
        .remote(name, rollout_model, config.model, config.rollout, run_id, config.seed + i, version)
        for i, name in enumerate(rollout_names)
    ]
    reward_names = [f"reward-{i}" for i in range(config.reward.num_workers)]
    reward = [
        ray.remote(RewardWorker)
        .options(name=name, num_cpus=config.reward.cpus_per_worker)
        .remote(name, config.reward.functions, config.reward.on_failure, config.reward.batch_size)
        for name in reward_names
    ]
    buffer = (
        ray.remote(EpisodeBuffer)
        .options(name="buffer", num_cpus=0)
        .remote(config.buffer.capacity_episodes, config.buffer.max_staleness)
    )
    learner = (
        ray.remote(LearnerActor)
        .options(name="learner", num_cpus=config.learner.cpus, num_gpus=config.learner.gpus)
        .remote(
            model_path,
            config.model,
            config.ppo,
            config.rollout.temperature,
            config.seed,
            "cuda" if config.learner.gpus > 0 else "cpu",
            checkpoint,
        )
    )
    actors = Actors(rollout, rollout_names, reward, reward_names, buffer, learner)
    timeout = config.ray.actor_start_timeout_s
    try:
        for name, handle in actors.all():
            wait_for(handle.__ray_ready__.remote(), name, "start-up", timeout)
    except ActorFailure:
        actors.kill()
        raise
    return actors
