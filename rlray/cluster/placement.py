"""Placement groups: each role's actors get their resources as the bundles of one group.

Rollout workers, reward workers (where the run has any) and the learner each reserve a
placement group before their actors start: one bundle per actor ({CPU, GPU, custom
resources}), with the role's strategy (rollout SPREAD by default, so that rollout
workers land on different nodes
when there are several; the learners PACK, on one node where they fit). On a GPU cluster
the bundles hold GPUs; here, CPUs. A rollout worker whose vLLM engine spans several GPUs
(rollout.tensor_parallel_size > 1) gets a group of its own instead: one GPU bundle per
rank on one node, its actor in the first bundle without GPUs of its own, and vLLM's Ray
executor places its rank workers in the group's bundles. A group that cannot be placed
within the start-up timeout is reported with what it needed and what the cluster has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlray.config import Config


@dataclass
class RoleResources:
    """What each actor of a role needs, how many there are, and how to place them."""

    role: str
    count: int
    cpus: float
    gpus: float
    custom: dict[str, float]
    strategy: str
    tensor_parallel: int = 1
    """GPUs (ranks) of one actor's engine; above 1, a STRICT_PACK group per actor."""

    def bundle(self) -> dict[str, float]:
        """Returns one actor's bundle (only the resources it asks for)."""
        bundle = {"CPU": self.cpus, "GPU": self.gpus, **self.custom}
        return {name: amount for name, amount in bundle.items() if amount > 0}

    def groups(self) -> list[tuple[list[dict[str, float]], str]]:
        """Returns the role's placement groups as (bundles, strategy): one group of one
        bundle per actor, or with tensor parallelism a group per actor of one GPU bundle
        per rank (the first also holds the actor's CPUs and custom resources)."""
        if self.tensor_parallel == 1:
            return [([self.bundle() for _ in range(self.count)], self.strategy)]
        first = {**self.bundle(), "GPU": 1.0}
        ranks = [first] + [{"GPU": 1.0} for _ in range(self.tensor_parallel - 1)]
        return [(ranks, "STRICT_PACK") for _ in range(self.count)]


def role_resources(config: Config) -> dict[str, RoleResources]:
    """Returns the resources of the rollout, reward and learner roles of a config."""
    rollout, reward, learner = config.rollout, config.reward, config.learner
    return {
        "rollout": RoleResources(
            "rollout",
            rollout.num_workers,
            rollout.cpus_per_worker,
            rollout.gpus_per_worker,
            rollout.resources,
            rollout.placement_strategy,
            rollout.tensor_parallel_size,
        ),
        "reward": RoleResources(
            "reward",
            reward.num_workers,
            reward.cpus_per_worker,
            0.0,
            reward.resources,
            reward.placement_strategy,
        ),
        # PACK: one node when the group fits on one, across nodes when it does not.
        "learner": RoleResources(
            "learner", learner.num_workers, learner.cpus, learner.gpus, learner.resources, "PACK"
        ),
    }


def colocated_resources(config: Config) -> RoleResources:
    """Returns the resources of the colocated role (ray.placement colocated): a bundle per
    learner holding its CPUs and its rollout engine's, the learner's GPUs (which the
    engine shares) and both roles' custom resources."""
    rollout, learner = config.rollout, config.learner
    custom = {**rollout.resources}
    for name, amount in learner.resources.items():
        custom[name] = custom.get(name, 0.0) + amount
    cpus = learner.cpus + rollout.cpus_per_worker
    return RoleResources("learner", learner.num_workers, cpus, learner.gpus, custom, "PACK")


class Placement:
    """The placement groups of one run, by role."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.groups: dict[str, list[Any]] = {}
        self.roles: dict[str, RoleResources] = {}

    def reserve(self, resources: RoleResources, timeout_s: float) -> str | None:
        """Creates the role's groups and waits until they are placed; returns None, or
        why they could not be placed within timeout_s. A role of no actors (reward
        actors with reward.num_workers 0) reserves nothing."""
        if resources.count == 0:
            return None
        shapes = resources.groups()
        role = resources.role
        names = [role] if len(shapes) == 1 else [f"{role}-{i}" for i in range(len(shapes))]
        self.groups[role] = [
            placement_group(bundles, strategy=strategy, name=f"{self.run_id}-{name}")
            for (bundles, strategy), name in zip(shapes, names, strict=True)
        ]
        self.roles[role] = resources
        ready, _ = ray.wait(
            [group.ready() for group in self.groups[role]],
            num_returns=len(shapes),
            timeout=timeout_s,
        )
        if len(ready) == len(shapes):
            return None
        bundles, strategy = shapes[0]
        return (
            f"{role}: no room within {timeout_s:.0f} s for {len(shapes)} x {bundles} "
            f"({strategy}); the cluster has {ray.cluster_resources()}"
        )

    def actor_options(self, role: str, index: int) -> dict[str, Any]:
        """Returns the .options() that put the index-th actor of a role in its bundle."""
        resources = self.roles[role]
        groups = self.groups[role]
        if resources.tensor_parallel == 1:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=groups[0], placement_group_bundle_index=index
            )
            gpus = resources.gpus
        else:  # vLLM's rank workers, started from the actor, take the group's GPUs
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=groups[index],
                placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True,
            )
            gpus = 0.0
        return {
            "num_cpus": resources.cpus,
            "num_gpus": gpus,
            "resources": dict(resources.custom),
            "scheduling_strategy": strategy,
        }

    def release(self) -> None:
        """Removes every group of the run (their resources go back to the cluster)."""
        for groups in self.groups.values():
            for group in groups:
                remove_placement_group(group)
        self.groups.clear()
