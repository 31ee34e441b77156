"""The config's checks: every number finite and in its field's range, then the rules that
tie fields together. Each names the bad field in one line (ConfigError).

File checks (model path, data files, prompt lengths) need the model's tokenizer and run
in rlray.driver.plan, before any actor starts.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from rlray.algorithms.estimators import ESTIMATORS
from rlray.config.schema import (
    Config,
    ConfigError,
    Range,
    RewardSpec,
    agent_token,
    did_you_mean,
    eval_rewards,
    field_types,
    ingest_token,
    weight_sync,
)
from rlray.core.evaluation import metric_names


def validate(config: Config) -> None:
    """Raises ConfigError naming the first bad field: a number that is not finite or out
    of its field's range, or a broken rule between fields."""
    for name, value, allowed in _numbers(config, Config):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be finite, got {value}")
        if allowed is not None and (problem := allowed.problem(value)):
            raise ConfigError(f"{name} {problem}")
    for rule in RULES:
        rule(config)


def _numbers(value: Any, kind: Any, name: str = "") -> Iterator[tuple[str, Any, Range | None]]:
    """Yields (dotted name, value, its field's range) of every number in the config, by
    the fields' types: reward.functions[0].weight and learner.resources.<key> included."""
    if dataclasses.is_dataclass(kind):
        for f in dataclasses.fields(kind):
            dotted = f"{name}.{f.name}" if name else f.name
            allowed = f.metadata.get("range")
            inner = field_types(kind)[f.name]
            for item_name, item, item_range in _numbers(getattr(value, f.name), inner, dotted):
                yield item_name, item, item_range or allowed
        return
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType) and value is not None:
        (inner,) = [t for t in typing.get_args(kind) if t is not type(None)]
        yield from _numbers(value, inner, name)
    elif origin is list:
        for i, item in enumerate(value):
            yield from _numbers(item, typing.get_args(kind)[0], f"{name}[{i}]")
    elif origin is dict:
        for key, item in value.items():
            yield from _numbers(item, typing.get_args(kind)[1], f"{name}.{key}")
    elif kind in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        yield name, value, None


# ---------------------------------------------------------------- rules between fields


def _lora(config: Config) -> None:
    lora = config.model.lora
    if lora.rank and not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}")
    if lora.rank and not lora.target_modules:
        raise ConfigError("model.lora.target_modules must name at least one module")
    if "all-linear" in lora.target_modules and len(lora.target_modules) > 1:
        raise ConfigError("model.lora.target_modules: all-linear stands alone")
    if lora.rank and config.learner.num_workers > 1:
        raise ConfigError(
            "model.lora with learner.num_workers > 1: LoRA adapters train in one learner"
        )


def _compile(config: Config) -> None:
    learner = config.learner
    if learner.compile and learner.num_workers > 1:
        raise ConfigError(
            f"learner.compile with learner.num_workers {learner.num_workers}: compiled "
            "layers are not built for a sharded learner group (one learner only)"
        )


def _borrow_idle_cores(config: Config) -> None:
    learner, rollout = config.learner, config.rollout
    if not learner.borrow_idle_cores:
        return
    where = [
        f"learner.num_workers {learner.num_workers}" if learner.num_workers > 1 else "",
        f"learner.gpus {learner.gpus:g}" if learner.gpus > 0 else "",
        f"rollout.gpus_per_worker {rollout.gpus_per_worker:g}" if rollout.gpus_per_worker else "",
        "ray.placement colocated" if config.ray.placement == "colocated" else "",
    ]
    problem = next((w for w in where if w), None)
    if problem:
        raise ConfigError(
            f"learner.borrow_idle_cores with {problem}: it lends idle rollout CPU cores to "
            "one learner on CPU, with the roles disaggregated"
        )


def _devices(config: Config) -> None:
    r, learner = config.rollout, config.learner
    if r.tensor_parallel_size > 1 and r.gpus_per_worker != r.tensor_parallel_size:
        raise ConfigError(
            f"rollout.tensor_parallel_size {r.tensor_parallel_size} needs "
            f"rollout.gpus_per_worker {r.tensor_parallel_size} (a GPU per rank), "
            f"got {r.gpus_per_worker}"
        )
    if r.weight_sync == "nccl" and not (learner.gpus > 0 and r.gpus_per_worker > 0):
        raise ConfigError(
            "rollout.weight_sync nccl needs GPUs on both ends: learner.gpus "
            f"{learner.gpus}, rollout.gpus_per_worker {r.gpus_per_worker}"
        )
    if r.weight_sync == "gloo" and r.tensor_parallel_size > 1:
        raise ConfigError(
            "rollout.weight_sync gloo with rollout.tensor_parallel_size > 1: the gloo "
            "engine is registered in the rollout actor's process, not in its ranks'"
        )
    needs = {
        "rollout.cpus_per_worker": r.cpus_per_worker
        + r.gpus_per_worker
        + sum(r.resources.values()),
        "learner.cpus": learner.cpus + learner.gpus + sum(learner.resources.values()),
    }
    if config.reward.num_workers > 0:  # else the store's process scores
        needs["reward.cpus_per_worker"] = config.reward.cpus_per_worker + sum(
            config.reward.resources.values()
        )
    for name, total in needs.items():
        if total <= 0:
            raise ConfigError(f"{name}: the actor must reserve some resource (CPU, GPU or custom)")


def _colocation(config: Config) -> None:
    r, learner = config.rollout, config.learner
    if learner.offload_optimizer and config.ray.placement != "colocated":
        raise ConfigError(
            "learner.offload_optimizer needs ray.placement colocated: a disaggregated "
            "learner has its devices to itself"
        )
    if learner.offload_optimizer and learner.num_workers > 1:
        raise ConfigError(
            f"learner.offload_optimizer with learner.num_workers {learner.num_workers}: "
            "offloading a sharded optimizer's state is not built (one learner only)"
        )
    if config.ray.placement != "colocated":
        return
    if r.num_workers != learner.num_workers:
        raise ConfigError(
            f"rollout.num_workers ({r.num_workers}) must equal learner.num_workers "
            f"({learner.num_workers}) with ray.placement colocated: each learner shares "
            "its process and devices with one rollout engine"
        )
    if r.weight_sync != "auto":
        raise ConfigError(
            f"rollout.weight_sync {r.weight_sync} with ray.placement colocated: a colocated "
            "engine takes its learner's weights in memory (leave it auto)"
        )
    if r.tensor_parallel_size > 1:
        raise ConfigError("rollout.tensor_parallel_size > 1 with ray.placement colocated")
    if r.gpus_per_worker != learner.gpus:
        raise ConfigError(
            f"rollout.gpus_per_worker ({r.gpus_per_worker}) must equal learner.gpus "
            f"({learner.gpus}) with ray.placement colocated: the engine and the learner "
            "share those devices"
        )
    if r.in_flight_updates and r.in_flight_kv_cache == "keep" and r.gpus_per_worker > 0:
        raise ConfigError(
            "rollout.in_flight_kv_cache keep with ray.placement colocated on GPUs: the "
            "engine's sleep frees the KV cache of the requests it carries over the "
            "learner's turn (use recompute)"
        )


def _seed(config: Config) -> None:
    # Worker i samples with seed + i, and numpy seeds are 32-bit.
    limit = 2**31 - 1 - config.rollout.num_workers
    if config.seed > limit:
        raise ConfigError(f"seed must be <= {limit} (numpy seeds are 32-bit), got {config.seed}")


def _preference(config: Config) -> None:
    preference = config.preference
    if not 0 <= preference.label_smoothing < 0.5:
        raise ConfigError(
            f"preference.label_smoothing must be in [0, 0.5), got {preference.label_smoothing}"
        )
    if preference.label_smoothing and preference.loss != "sigmoid":
        raise ConfigError("preference.label_smoothing applies to the sigmoid loss only")


def _algorithm(config: Config) -> None:
    a = config.algorithm
    if a.advantage == "grpo" and a.kl_mode == "reward" and a.kl_coef > 0:
        raise ConfigError(
            "algorithm.kl_mode reward with advantage grpo: dividing by a group's reward std "
            "turns the KL penalty of a group whose rewards are equal into full-size "
            "advantages; use kl_mode loss (k2 or k3) or kl_coef 0"
        )
    if a.kl_mode == "loss" and a.kl_estimator == "k1" and a.kl_coef > 0:
        raise ConfigError(
            "algorithm.kl_estimator k1 with kl_mode loss has zero gradient in expectation; "
            "use k2 or k3 (or kl_mode reward with k1)"
        )
    # In the reward, an estimator's policy gradient is E[k grad log pi]: the KL's gradient
    # for k1 only; k3's is grad KL(pi || ref) - grad KL(ref || pi), of either sign.
    if a.kl_mode == "reward" and a.kl_estimator != "k1" and a.kl_coef > 0:
        raise ConfigError(
            f"algorithm.kl_estimator {a.kl_estimator} with kl_mode reward is not a KL "
            "penalty: its policy gradient is not the KL's and may raise the KL; use k1 "
            "(or kl_mode loss with k2 or k3)"
        )
    if a.clip_low is not None and a.clip_low > 1 and a.policy_loss != "cispo":
        raise ConfigError(f"algorithm.clip_low must be <= 1 (a ratio is > 0), got {a.clip_low}")
    if ESTIMATORS[a.advantage].compares_groups and config.rollout.samples_per_prompt < 2:
        raise ConfigError(
            f"rollout.samples_per_prompt must be >= 2 for algorithm.advantage {a.advantage} "
            "(it compares the samples of each prompt)"
        )


def _rollout(config: Config) -> None:
    r = config.rollout
    if r.min_new_tokens > r.max_new_tokens:
        raise ConfigError(
            f"rollout.min_new_tokens ({r.min_new_tokens}) must be <= rollout.max_new_tokens "
            f"({r.max_new_tokens})"
        )
    # That stop token ids are in the model's vocabulary is checked with the model.
    for i, text in enumerate(r.stop):
        if not text:
            raise ConfigError(f"rollout.stop[{i}] is empty (an empty stop string ends at once)")
    for i, token in enumerate(r.stop_token_ids):
        if token < 0:
            raise ConfigError(f"rollout.stop_token_ids[{i}] must be >= 0, got {token}")


def _batch_sizes(config: Config) -> None:
    learner = config.learner
    if learner.episodes_per_step % config.rollout_batch_episodes:
        raise ConfigError(
            f"learner.episodes_per_step ({learner.episodes_per_step}) must be a multiple of the "
            f"rollout batch (rollout.prompts_per_batch x rollout.samples_per_prompt = "
            f"{config.rollout_batch_episodes})"
        )
    if learner.episodes_per_step % learner.minibatch_episodes:
        raise ConfigError(
            f"learner.minibatch_size ({learner.minibatch_size}) must divide "
            f"learner.episodes_per_step ({learner.episodes_per_step})"
        )
    if learner.minibatch_episodes % learner.micro_batch_rows:
        whole = " (0: the step's episodes)" if learner.minibatch_size == 0 else ""
        raise ConfigError(
            f"learner.micro_batch_size ({learner.micro_batch_rows}) must divide "
            f"learner.minibatch_size ({learner.minibatch_episodes}{whole})"
        )
    if config.buffer.capacity_episodes < learner.episodes_per_step:
        raise ConfigError(
            f"buffer.capacity_episodes ({config.buffer.capacity_episodes}) must hold one "
            f"learner step (learner.episodes_per_step = {learner.episodes_per_step})"
        )
    if config.buffer.max_staleness < learner.sync_every - 1:
        raise ConfigError(
            f"buffer.max_staleness ({config.buffer.max_staleness}) must be >= "
            f"learner.sync_every - 1 ({learner.sync_every - 1}): rollouts lag that far "
            "between weight syncs"
        )


def _ingest(config: Config) -> None:
    ingest = config.ingest
    loopback = ingest.host in ("127.0.0.1", "::1", "localhost") or ingest.host.startswith("127.")
    if ingest.enabled and not ingest_token(ingest) and not loopback:
        raise ConfigError(
            f"ingest.host: serving {ingest.host} needs a token (ingest.token or "
            "RLRAY_INGEST_TOKEN); without one only loopback (127.0.0.1) is served"
        )


def _agent(config: Config) -> None:
    agent = config.agent
    if not agent.enabled:
        return
    if not agent_token(agent):
        raise ConfigError(
            "agent.token: the agent endpoint needs a bearer token (agent.token or "
            "RLRAY_AGENT_TOKEN); agents send it as the openai client's api_key"
        )
    if config.rollout.environment:
        raise ConfigError(
            "agent.enabled: agents drive their own turns; rollout.environment "
            f"({config.rollout.environment}) must be empty"
        )
    if config.ray.placement == "colocated":
        raise ConfigError(
            "agent.enabled: the agent endpoint needs disaggregated placement "
            "(ray.placement: a colocated engine serves one call at a time)"
        )


def _rewards(config: Config) -> None:
    if not config.reward.functions:
        raise ConfigError("reward.functions must name at least one reward")
    for i, spec in enumerate(config.reward.functions):
        _reward_schedule(f"reward.functions[{i}]", spec)
    for i, spec in enumerate(config.eval.rewards):
        _reward_schedule(f"eval.rewards[{i}]", spec)


def _reward_schedule(name: str, spec: RewardSpec) -> None:
    if any(len(point) != 2 for point in spec.schedule):
        raise ConfigError(
            f"{name}.schedule: each point must be [step, weight], got {spec.schedule}"
        )
    steps = [point[0] for point in spec.schedule]
    if steps != sorted(steps) or len(set(steps)) != len(steps) or any(s < 0 for s in steps):
        raise ConfigError(f"{name}.schedule: steps must be >= 0 and increasing, got {steps}")


def _evaluation(config: Config) -> None:
    e = config.eval
    if e.samples and not e.temperature > 0:
        raise ConfigError(f"eval.temperature must be > 0 with eval.samples, got {e.temperature}")
    for i, k in enumerate(e.pass_k if e.samples else []):
        if not 1 <= k <= e.samples:
            raise ConfigError(
                f"eval.pass_k[{i}] must be in [1, eval.samples = {e.samples}], got {k}"
            )
    names = [spec.name for spec in eval_rewards(config)]
    known = metric_names(names, e.samples, e.pass_k)
    if e.best_metric and e.best_metric not in known:
        raise ConfigError(
            f"eval.best_metric: no metric {e.best_metric!r}{did_you_mean(e.best_metric, known)}; "
            f"with these settings there are {', '.join(known)}"
        )


def _simulator(config: Config) -> None:
    rollout, learner = config.rollout.backend, config.learner.backend
    if (rollout == "simulated") != (learner == "simulated"):
        raise ConfigError(
            f"rollout.backend {rollout} with learner.backend {learner}: the simulated "
            "engine and learner run together (their logprobs and weights are each other's)"
        )
    if rollout != "simulated":
        return
    learners, sync = config.learner.num_workers, config.rollout.weight_sync
    where = [
        "ray.placement colocated" if config.ray.placement == "colocated" else "",
        "agent.enabled" if config.agent.enabled else "",
        "ingest.train" if config.ingest.enabled and config.ingest.train else "",
        "rollout.environment" if config.rollout.environment else "",
        "rollout.in_flight_updates" if config.rollout.in_flight_updates else "",
        f"learner.num_workers {learners}" if learners > 1 else "",
        f"rollout.weight_sync {sync}" if sync in ("nccl", "gloo") else "",
    ]
    problem = next((w for w in where if w), None)
    if problem:
        raise ConfigError(
            f"rollout.backend simulated with {problem}: the simulator models single-turn "
            "batches, one learner and the object-store weight sync, disaggregated"
        )


def _weight_relay(config: Config) -> None:
    path = weight_sync(config)
    if config.rollout.weight_relay and path != "object_store":
        how = "in memory (ray.placement colocated)" if path == "in_memory" else f"by {path}"
        raise ConfigError(
            "rollout.weight_relay orders the object-store weight sync's loads; this run's "
            f"weights go {how}"
        )


RULES: tuple[Callable[[Config], None], ...] = (
    _lora,
    _compile,
    _borrow_idle_cores,
    _devices,
    _colocation,
    _seed,
    _preference,
    _algorithm,
    _rollout,
    _batch_sizes,
    _ingest,
    _agent,
    _rewards,
    _evaluation,
    _simulator,
    _weight_relay,
)
"""The rules between fields, in the order they are checked."""
