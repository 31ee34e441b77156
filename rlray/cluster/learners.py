"""The learners' Ray faces: a learner (RL or preference) per rank, a group called as one,
and the client a learner's weight transfer calls rollout workers through.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rlray.cluster.calls import resolve_episodes, wait_for
from rlray.cluster.telemetry import Telemetry
from rlray.config import Config
from rlray.core.episode import Episode
from rlray.core.idle_cores import IdleCores
from rlray.core.parity import ParitySample
from rlray.core.stats import StepMetrics
from rlray.observe.console import send_engine_output_to

if TYPE_CHECKING:  # torch stays out of this module: every actor process imports it
    from rlray.weights.packing import PackedWeights


class _GroupMember:
    """A learner of a group, built in two steps so that the group's rank 0 can name its
    address before any learner joins (`setup`)."""

    rank: int
    world_size: int

    def rendezvous(self) -> tuple[str, int]:
        """Returns this node's address and a free port: rank 0's are the group's."""
        # torch loads in learner processes only (every actor imports this module)
        from rlray.learner.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def _join(self, address: str, port: int, device: str, timeout_s: float) -> None:
        """Joins the learner group, when there is more than one learner."""
        if self.world_size > 1:
            # as in rendezvous
            from rlray.learner.distributed import join_group

            join_group(self.rank, self.world_size, address, port, device, timeout_s)


class LearnerActor(_GroupMember):
    """The Learner, plus what needs Ray: it resolves episode references itself, so
    episode data goes object store -> learner and never through the driver. It holds the
    Learner rather than being one so that this module, which every actor and the driver
    import, does not import torch (private memory each process would hold for nothing).

    One of `world_size` learners: its models are sharded across the group."""

    def __init__(
        self,
        run_id: str,
        rank: int,
        world_size: int,
        *args: Any,
        engine_log: str | None = None,
        borrows_cores: bool = False,
        **kwargs: Any,
    ):
        """`borrows_cores`: train on this node's idle rollout cores too
        (learner.borrow_idle_cores)."""
        send_engine_output_to(engine_log)  # torch's output, rlray.observe.console
        self.rank, self.world_size = rank, world_size
        self.learner_args, self.learner_kwargs = args, kwargs
        self.weights_sent_at = 0.0
        """When this learner last published or sent weights (time.monotonic)."""
        self.idle_cores = IdleCores(run_id)
        if borrows_cores:
            self.learner_kwargs = {**kwargs, "lent_cores": self._lent_cores}
        self.learner_telemetry = Telemetry(run_id, "learner" if rank == 0 else f"learner-{rank}")

    def _lent_cores(self) -> int:
        """The cores this node's rollout workers lend now: those idle since the last
        weights were sent (a worker idle from before loads them and generates next)."""
        return self.idle_cores.idle(since=self.weights_sent_at)

    def setup(self, address: str, port: int, timeout_s: float) -> None:
        """Joins the learner group, then builds the Learner."""
        # as in rendezvous
        from rlray.learner.rl import Learner

        self._join(address, port, self.learner_kwargs.get("device", "cpu"), timeout_s)
        self.learner = Learner(*self.learner_args, **self.learner_kwargs)

    def train_on(self, batch_refs: list[list[Any]], timeout_s: float) -> StepMetrics:
        """Fetches the referenced episode batches and runs one learner step on them."""
        metrics = self.learner.train_step(resolve_episodes(batch_refs, timeout_s))
        self.learner_telemetry.set("rlray_reward_mean", metrics.reward_mean)
        self.learner_telemetry.set("rlray_learner_step_seconds", metrics.learner_seconds)
        self.learner_telemetry.set("rlray_logprob_parity_error", metrics.logprob_parity_error)
        self.learner_telemetry.set(
            "rlray_rollout_logprob_diff_mean", metrics.rollout_logprob_diff_mean
        )
        self.learner_telemetry.set("rlray_policy_version", metrics.policy_version)
        return metrics

    def publish_weights(self) -> tuple[int, PackedWeights]:
        """Returns (version, weights) packed as byte arrays. Returned from an actor method,
        they are stored once in the object store, owned by the caller; rollout workers on
        the same node then read the arrays without a copy."""
        # as in rendezvous
        from rlray.weights.packing import pack_weights

        weights = pack_weights(self.learner.published_weights(), self.learner.tied_output)
        self.weights_sent_at = time.monotonic()
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
        """Opens vLLM's weight transfer to the named rollout workers (rlray.weights.transfer);
        every learner of a group opens it, rank 0's address and port are the group's."""
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
        self.weights_sent_at = time.monotonic()
        return self.learner.send_weights()

    def close_weight_transfer(self) -> None:
        self.learner.close_weight_transfer()

    def parity_sample(self) -> ParitySample:
        return self.learner.parity_sample()

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        return self.learner.logprobs(episodes)

    def save_checkpoint(
        self,
        run_dir: str,
        prompt_cursor: int,
        publish: bool = True,
        replay_prompts: list[int] | None = None,
    ) -> Path:
        return self.learner.save_checkpoint(run_dir, prompt_cursor, publish, replay_prompts)

    def publish_staged(self, run_dir: str, version: int, keep: bool) -> Path | None:
        return self.learner.publish_staged(run_dir, version, keep)

    def state(self) -> dict[str, Any]:
        return self.learner.state()


class PreferenceActor(_GroupMember):
    """A PreferenceLearner (rlray/learner/preference.py) in jobs/dpo.py's learner group: it
    builds each step's pairs itself, so the driver sends only step numbers."""

    def __init__(self, rank: int, world_size: int, config: Config, model_path: str, device: str):
        self.rank, self.world_size = rank, world_size
        self.config, self.model_path, self.device = config, model_path, device

    def setup(self, address: str, port: int, timeout_s: float) -> None:
        """Joins the learner group, then builds the PreferenceLearner."""
        # as in rendezvous
        from rlray.learner.preference import PreferenceLearner

        self._join(address, port, self.device, timeout_s)
        self.learner = PreferenceLearner(self.config, self.model_path, self.device)

    def step(self, step: int) -> dict[str, float]:
        return self.learner.step(step)

    def evaluate(self, step: int) -> dict[str, float]:
        return self.learner.evaluate(step)

    def publish_weights(self, step: int) -> tuple[int, PackedWeights | None]:
        return self.learner.publish_weights(step)

    def save_checkpoint(self, run_dir: str, step: int) -> None:
        self.learner.save_checkpoint(run_dir, step)


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


class RolloutClient:
    """vLLM's weight-sync client protocol over the rollout actors: each call goes to every
    worker at once and waits for all of them, at most timeout_s (a worker that does not
    answer is named). `version` is what finish_weight_update tells them they hold."""

    def __init__(self, workers: list[tuple[str, Any]], timeout_s: float, ranks_per_worker: int = 1):
        self.workers = workers
        self.timeout_s = timeout_s
        self.ranks_per_worker = ranks_per_worker
        self.version = 0

    def _all(self, method: str, *args: Any) -> None:
        self._wait([(name, getattr(actor, method).remote(*args)) for name, actor in self.workers])

    def _wait(self, refs: list[tuple[str, Any]]) -> None:
        for name, ref in refs:
            wait_for(ref, name, "weight transfer", self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        # vLLM numbers an engine's ranks from the offset it is given, as if the engines
        # were data-parallel replicas of one deployment; rlray's workers are separate
        # engines, so each gets the offset after the ranks of the workers before it.
        offset = init_info["rank_offset"]
        refs = []
        for index, (name, actor) in enumerate(self.workers):
            own = {**init_info, "rank_offset": offset + index * self.ranks_per_worker}
            refs.append((name, actor.open_weight_transfer.remote(own)))
        self._wait(refs)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", self.version)
