"""Starting a run's actors: placement groups reserved per role, named actors started in
them, each waited for with a timeout; where each runs, and how to stop them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlray.agent.gateway import CallLimits
from rlray.cluster.calls import ActorFailure, wait_for
from rlray.cluster.colocated import ColocatedActor
from rlray.cluster.endpoints import AgentActor, IngestActor
from rlray.cluster.learners import LearnerActor, LearnerGroup, PreferenceActor, learner_names
from rlray.cluster.placement import Placement, colocated_resources, role_resources
from rlray.cluster.roles import (
    STORE_GROUPS,
    EpisodesActor,
    RewardActor,
    StoreActor,
    rollout_actor_class,
)
from rlray.cluster.serving import endpoint_options, free_port
from rlray.cluster.simulated import SimulatedLearnerActor, SimulatedRolloutActor
from rlray.config import Config, agent_token, ingest_token, weight_sync
from rlray.core.checkpoints import checkpoint_version
from rlray.core.idle_cores import IdleCores
from rlray.core.waiting import Durations, timed_wait
from rlray.data.cache import cache_dir
from rlray.data.models import model_limits
from rlray.rollout.worker import vllm_env

logger = logging.getLogger(__name__)


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
    store_shards: list[Any] = field(default_factory=list)
    """The store's shards after the first (store.shards), named store-1, store-2, ...:
    store actors of their own, beside `store`."""
    learner: LearnerGroup | None = None
    ingest: Any = None
    agent: Any = None
    """The agent endpoint (agent.enabled): rollout batches are made through it."""
    placement: Placement | None = None

    def handle(self, name: str) -> Any:
        """Returns the handle of the actor called `name`."""
        return dict(self.all())[name]

    def name_of(self, actor_id: str | None) -> str | None:
        """Returns the name of the actor with this (hex) id, None if not one of ours."""
        ids = {handle._actor_id.hex(): name for name, handle in self.all()}
        return ids.get(actor_id) if actor_id else None

    def all(self) -> list[tuple[str, Any]]:
        """Returns (name, handle) of every actor; a process's first name is its own (the
        store's before the buffer's and a scoring store's `reward`, a colocated engine's
        before its learner's)."""
        singles = [("store", self.store), ("buffer", self.buffer), ("ingest", self.ingest)]
        singles.append(("agent", self.agent))
        learners = self.learner or LearnerGroup([])
        return [
            *zip(self.rollout_names, self.rollout, strict=True),
            *((name, handle) for name, handle in singles if handle is not None),
            *self.stores()[1:],
            *zip(self.reward_names, self.reward, strict=True),
            *zip(learners.names, learners.handles, strict=True),
        ]

    def stores(self) -> list[tuple[str, Any]]:
        """Returns (name, handle) of every shard of the store, `store` first."""
        shards = [(f"store-{i}", handle) for i, handle in enumerate(self.store_shards, 1)]
        return [("store", self.store), *shards]

    def process_name(self, name: str) -> str:
        """Returns the first name of the process of actor `name` (see `all`): the one its
        restarts are counted under."""
        handle = self.handle(name)
        return next(other for other, h in self.all() if h is handle)

    def sharing(self, name: str) -> list[str]:
        """Returns the names of every role in the process of actor `name`, its own first
        (a training run's store and buffer are one; a colocated rollout-i and learner-i)."""
        handle = self.handle(name)
        return [name, *(other for other, h in self.all() if h is handle and other != name)]

    def restart_counts(self) -> dict[str, int]:
        """Returns how many times Ray restarted each actor process, by the name of its
        first role (`store` for the store and the buffer): Ray's own record (its control
        store's), so one death is one restart however many calls it failed. One query
        for the job's actors (a query an actor was a round trip per engine each step)."""
        from ray._private import state  # Ray's public state API needs the dashboard running

        job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        table = state.actors(job_id=job)
        counts: dict[str, int] = {}
        seen: set[int] = set()
        for name, handle in self.all():
            if id(handle) not in seen:
                seen.add(id(handle))
                record = table.get(handle._actor_id.hex(), {})
                counts[name] = int(record.get("NumRestarts", 0))
        return counts

    def close_agent(self, timeout_s: float) -> None:
        """Tells the agent endpoint, if any, that the run needs no more traces, and waits
        until the agents waiting for a task heard it (before kill() takes it away)."""
        if self.agent is None:
            return
        try:
            wait_for(self.agent.close.remote(), "agent", "close", timeout_s)
        except ActorFailure as err:
            logger.warning("agents waiting for a task may not have heard the run ended: %s", err)

    def kill(self, release_timeout_s: float = 10.0) -> None:
        """Stops every actor (their names become free for the next run) and gives their
        placement groups back. Ray's node on this machine may be gone (a service
        manager's stop signals every process of the service: the raylet stops, Ray's
        GCS does not, and its removal of a placement group then never returns): a
        release that has not returned within `release_timeout_s` is left behind, with a
        warning, and so is the wait for the names."""
        for _, handle in self.all():
            ray.kill(handle, no_restart=True)
        if self.placement is not None:
            released = _returns_within(self.placement.release, release_timeout_s)
            IdleCores(self.placement.run_id).remove()  # the board on this node
            if not released:
                logger.warning("the run's placement groups were not given back: Ray's node "
                               "on this machine is gone or does not answer")  # fmt: skip
                return
        _wait_until_names_free([name for name, _ in self.all()], timeout_s=60)


def _returns_within(call: Callable[[], None], timeout_s: float) -> bool:
    """Runs `call` in a daemon thread; returns whether it returned within timeout_s (an
    error it raised is raised here). A call that does not return is left running."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as err:  # handed to the caller
            errors.append(err)

    thread = threading.Thread(target=run, name="bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    return not thread.is_alive()


def restart_count(handle: Any) -> int:
    """Returns how many times Ray restarted the actor behind `handle`."""
    from ray._private import state  # Ray's public state API needs the dashboard running

    return int(state.actors(actor_id=handle._actor_id.hex()).get("NumRestarts", 0))


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
    colocated = train and config.ray.placement == "colocated"
    roles = role_resources(config)
    if colocated:  # one role holds the learners and their engines
        roles = {"reward": roles["reward"], "learner": colocated_resources(config)}
    for role in roles if train else ("rollout", "reward"):
        problem = placement.reserve(roles[role], timeout)
        if problem:
            placement.release()
            raise ActorFailure(problem)
    rollout_names = [f"rollout-{i}" for i in range(config.rollout.num_workers)]
    reward_names = [f"reward-{i}" for i in range(config.reward.num_workers)]
    store = _start_store(config, run_id, train)
    shards = [_start_store_shard(config, run_id, i) for i in range(1, config.store.shards)]
    if colocated:
        rollout = _start_colocated(config, rollout_names, model_path, run_id, checkpoint, placement)
    else:
        rollout = _start_rollout_workers(
            config, rollout_names, model_path, run_id, checkpoint, placement, awaits_weights=train
        )
    actors = Actors(
        rollout=rollout,
        rollout_names=rollout_names,
        reward=[
            _start_reward_worker(config, name, run_id, placement.actor_options("reward", i))
            for i, name in enumerate(reward_names)
        ]
        or [store],
        reward_names=reward_names or [STORE_SCORER],
        store=store,
        store_shards=shards,
        placement=placement,
    )
    if train:
        actors.buffer = actors.store  # one process, EpisodesActor
        actors.learner = (
            LearnerGroup(rollout)
            if colocated
            else _start_learners(config, model_path, run_id, checkpoint, placement)
        )
    try:
        _set_up(actors, config, timeout)
    except ActorFailure:
        actors.kill()
        raise
    return actors


STORE_SCORER = "reward"
"""The role name of a store that scores (reward.num_workers 0): its restarts are the
store's, and a failed scoring call names it."""


def _store_options(config: Config, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "num_cpus": 0,
        "max_restarts": config.ray.max_actor_restarts,
        # Beside the driver: it writes into the run directory (the driver's disk), and a
        # restarted store must find its journal there.
        "scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    }


def _start_store_shard(config: Config, run_id: str, shard: int) -> Any:
    """Starts shard `shard` (1 and up) of the run's store, named store-<shard>: a store
    actor that writes episodes only (no buffer, no scoring)."""
    actor = ray.remote(concurrency_groups=STORE_GROUPS)(StoreActor)
    options = _store_options(config, f"store-{shard}")
    return actor.options(**options).remote(config.store, config.run_dir, run_id, None, shard)


def _start_store(config: Config, run_id: str, train: bool) -> Any:
    """Starts the run's store, named `store`: with the buffer in its process in a training
    run (EpisodesActor), alone in a collect-only one; scoring too with reward.num_workers
    0 (the rewards' own child process starts with it)."""
    options = _store_options(config, "store")
    scorer = None if config.reward.num_workers else _reward_arguments(config, STORE_SCORER)
    if scorer is not None:
        # A scoring call is sent once its batch is generated: in order, every call to
        # this process made after it (a step's take, a store write) would wait for that
        # generation too. The driver waits for each buffer call before the next.
        options["allow_out_of_order_execution"] = True
    if not train:
        actor = ray.remote(concurrency_groups=STORE_GROUPS)(StoreActor).options(**options)
        return actor.remote(config.store, config.run_dir, run_id, scorer)
    buffer = config.buffer
    actor = ray.remote(concurrency_groups=STORE_GROUPS)(EpisodesActor).options(**options)
    return actor.remote(
        run_id,
        buffer.capacity_episodes,
        buffer.max_staleness,
        config.store,
        config.run_dir,
        scorer,
    )


def _start_rollout_workers(
    config: Config,
    names: list[str],
    model_path: str,
    run_id: str,
    checkpoint: str | None,
    placement: Placement,
    awaits_weights: bool = True,
) -> list[Any]:
    # Rollout workers start from the run's base model; a resumed run's checkpoint weights
    # reach them with the first weight sync, so the checkpoint need not be on their node.
    rollout_model = _model_for_actors(config, model_path)
    version = checkpoint_version(checkpoint) if checkpoint else 0
    if config.rollout.backend == "simulated":
        return _start_simulated_workers(config, names, run_id, version, placement, awaits_weights)
    env = {"env_vars": vllm_env(config.rollout)}
    rollout = replace(config.rollout, weight_sync=weight_sync(config))
    if config.agent.enabled:
        # Agents' calls run across weight loads, as requests do with in-flight updates.
        rollout = replace(rollout, in_flight_updates=True)
    actor_class = rollout_actor_class(rollout.weight_sync in ("nccl", "gloo"))
    return [
        actor_class.options(
            name=name,
            runtime_env=env,
            max_restarts=config.ray.max_actor_restarts,
            # In-flight weight updates: a load (or a second batch) runs while a batch
            # generates, each call in a thread of its own (rlray.rollout.engine_loop).
            max_concurrency=_rollout_concurrency(config),
            **placement.actor_options("rollout", i),
        ).remote(
            name,
            rollout_model,
            config.model,
            rollout,
            run_id,
            config.seed + i,
            version,
            awaits_weights=awaits_weights,
            engine_log=engine_log(config, name),
            lends_cores=config.learner.borrow_idle_cores,
        )
        for i, name in enumerate(names)
    ]


def _start_simulated_workers(
    config: Config,
    names: list[str],
    run_id: str,
    version: int,
    placement: Placement,
    awaits_weights: bool,
) -> list[Any]:
    """Starts simulated engines in the rollout workers' places (rlray.cluster.simulated)."""
    return [
        ray.remote(SimulatedRolloutActor)
        .options(
            name=name,
            max_restarts=config.ray.max_actor_restarts,
            **placement.actor_options("rollout", i),
        )
        .remote(
            name,
            config.rollout,
            config.simulator,
            run_id,
            config.seed + i,
            version,
            awaits_weights=awaits_weights,
        )
        for i, name in enumerate(names)
    ]


def _rollout_concurrency(config: Config) -> int:
    """Returns how many calls a rollout actor runs at once: agents' model calls (and a
    weight load and an evaluation beside them), two batches and a load with in-flight
    updates, else one at a time."""
    if config.agent.enabled:
        return config.agent.max_concurrent_calls + 2
    return 3 if config.rollout.in_flight_updates else 1


def _start_colocated(
    config: Config,
    names: list[str],
    model_path: str,
    run_id: str,
    checkpoint: str | None,
    placement: Placement,
) -> list[Any]:
    """Starts each learner with its rollout engine in one actor (rlray.cluster.colocated),
    named as the learner; the driver holds it as both."""
    device = "cuda" if config.learner.gpus > 0 else "cpu"
    model = _model_for_actors(config, model_path)
    version = checkpoint_version(checkpoint) if checkpoint else 0
    count = config.learner.num_workers
    handles = []
    for rank, (rollout_name, name) in enumerate(zip(names, learner_names(count), strict=True)):
        rollout_args = (rollout_name, model, config.model, config.rollout, run_id)
        rollout_args += (config.seed + rank, version)
        learner_args = (run_id, rank, count, model, config.model, config.algorithm)
        learner_args += (config.learner,)
        learner_kwargs = _learner_kwargs(config, device, checkpoint)
        handles.append(
            ray.remote(ColocatedActor)
            .options(
                name=name,
                runtime_env={"env_vars": vllm_env(config.rollout)},
                **placement.actor_options("learner", rank),
            )
            .remote(rollout_args, learner_args, learner_kwargs, engine_log(config, name))
        )
    return handles


def engine_log(config: Config, actor: str) -> str | None:
    """Returns the file an engine actor's own output goes to: run_dir/logs/<actor>.log."""
    return str(Path(config.run_dir) / "logs" / f"{actor}.log") if config.run_dir else None


def _start_reward_worker(config: Config, name: str, run_id: str, options: dict) -> Any:
    return (
        ray.remote(RewardActor)
        .options(name=name, max_restarts=config.ray.max_actor_restarts, **options)
        .remote(run_id, *_reward_arguments(config, name))
    )


def _reward_arguments(config: Config, name: str) -> tuple:
    """Returns a RewardWorker's arguments: its name, the rewards and how to call them."""
    reward = config.reward
    return (name, reward.functions, reward.on_failure, reward.batch_size, config.eval.rewards)


def _start_learners(
    config: Config, model_path: str, run_id: str, checkpoint: str | None, placement: Placement
) -> LearnerGroup:
    if config.learner.backend == "simulated":
        (name,) = learner_names(1)
        options = placement.actor_options("learner", 0)
        actor = ray.remote(SimulatedLearnerActor).options(name=name, **options)
        return LearnerGroup([actor.remote(run_id, config, checkpoint)])
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
                **_learner_kwargs(config, device, checkpoint),
                engine_log=engine_log(config, name),
                borrows_cores=config.learner.borrow_idle_cores,
            )
        )
        group.handles.append(handle)
    return group


def start_preference_learners(
    config: Config, model_path: str, run_id: str, evaluator: bool
) -> Actors:
    """Reserves placement for jobs/dpo.py's learner group (and, if `evaluator`, one
    rollout actor, `eval`, for its greedy evaluations), starts them and waits, with a
    timeout, until each learner has joined the group and built its models."""
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
            .remote(rank, count, config, model, device)
            for rank, name in enumerate(learner_names(count))
        ]
    )
    names = ["eval"] if evaluator else []
    rollout = _start_rollout_workers(config, names, model_path, run_id, None, placement)
    actors = Actors(rollout, names, [], [], None, learner=group, placement=placement)
    try:
        _set_up(actors, config, timeout)
    except ActorFailure:
        actors.kill()
        raise
    return actors


def _learner_kwargs(config: Config, device: str, checkpoint: str | None) -> dict[str, Any]:
    """Returns the Learner's keyword arguments (rlray.learner.rl.Learner)."""
    return {
        "max_new_tokens": config.completion_budget,
        "samples_per_prompt": config.rollout.samples_per_prompt,
        "temperature": config.rollout.temperature,
        "seed": config.seed,
        "device": device,
        "checkpoint": checkpoint,
    }


START_UP_GUESS_S = 60.0
"""The countdown's estimate of the actors' start-up where this machine has not started
the same actors before (after that, it counts down from their last start-up)."""


def _set_up(actors: Actors, config: Config, timeout_s: float) -> None:
    """Waits, with a timeout each, until every actor is up and every learner has joined
    its group and built its Learner, under a countdown (by the last start-up of the same
    actors and model on this machine). The learners build while the other actors start
    (on CPU an engine's start is mostly importing vLLM, on one core, and a learner's
    build overlaps it on another, so the first evaluation comes sooner), except where
    both roles are on GPUs: an engine measures its GPU's
    free memory as it starts, and a learner that shares the GPU must not hold part of
    it yet."""
    names = ", ".join(name for name, _ in actors.all())
    key = f"start-up {config.model.path} {config.ray.placement}: {names}"
    waits = Durations.in_folder(cache_dir())
    with timed_wait("starting the actors", key, waits, START_UP_GUESS_S):
        group = actors.learner
        overlap = learners_build_while_engines_start(config)
        setups = _start_setting_up(group, timeout_s) if group is not None and overlap else []
        for name, handle in actors.all():
            wait_for(handle.__ray_ready__.remote(), name, "start-up", timeout_s)
        if group is not None and not overlap:
            setups = _start_setting_up(group, timeout_s)
        for name, ref in setups:
            wait_for(ref, name, "start-up", timeout_s)


def learners_build_while_engines_start(config: Config) -> bool:
    """Whether the learners build while the rollout engines start (`_set_up`): unless
    both are on GPUs, where they may share one."""
    return not (config.learner.gpus > 0 and config.rollout.gpus_per_worker > 0)


def _start_setting_up(group: LearnerGroup, timeout_s: float) -> list[tuple[str, Any]]:
    """Has every learner join the group at rank 0's address and build its Learner;
    returns each learner's (name, setup call) without waiting for them."""
    address, port = wait_for(group.handles[0].rendezvous.remote(), "learner", "start-up", timeout_s)
    refs = [handle.setup.remote(address, port, timeout_s) for handle in group.handles]
    return list(zip(group.names, refs, strict=True))


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


def start_ingest(
    config: Config, actors: Actors, model_path: str, run_dir: str, timeout_s: float
) -> str:
    """Starts the ingestion endpoint as the `ingest` endpoint actor (restarted by Ray
    on this node whenever it dies); returns its URL."""
    token = ingest_token(config.ingest)
    limits = model_limits(model_path, config.model.max_model_len)  # checked in plan_run
    actors.ingest = (
        ray.remote(IngestActor)
        .options(**endpoint_options("ingest"))
        .remote(
            config.ingest,
            token,
            model_path,
            actors.reward,
            actors.store,
            actors.buffer,
            limits,
            str(Path(run_dir) / "ingest" / "accepted-episode-ids"),
        )
    )
    return wait_for(actors.ingest.url.remote(), "ingest", "start-up", timeout_s)


def start_agent(config: Config, actors: Actors, model_path: str, run_id: str) -> str:
    """Starts the agent endpoint as the `agent` endpoint actor, serving the rollout
    workers' engines; returns its URL."""
    limits = CallLimits(
        max_model_len=config.model.max_model_len,
        max_new_tokens=config.rollout.max_new_tokens,
        trace_tokens=config.rollout.turn_budget,
        max_calls=config.agent.max_calls_per_trace,
        temperature=config.rollout.temperature,
    )
    options = endpoint_options("agent", max_concurrency=config.agent.max_concurrent_calls + 8)
    # Restarted by Ray, it listens on the same port: agent.port 0 is settled here.
    agent = replace(config.agent, port=config.agent.port or free_port(config.agent.host))
    actors.agent = (
        ray.remote(AgentActor)
        .options(**options)
        .remote(
            agent,
            agent_token(config.agent),
            model_path,
            actors.rollout_names,
            limits,
            run_id,
        )
    )
    return wait_for(
        actors.agent.url.remote(), "agent", "start-up", config.ray.actor_start_timeout_s
    )
