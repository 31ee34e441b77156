"""Placement groups: each role's actors get their resources as the bundles of one group.

Rollout workers, reward workers and the learner each reserve a placement group before
their actors start: one bundle per actor ({CPU, GPU, custom resources}), with the role's
strategy (rollout SPREAD by default, so that rollout workers land on different nodes
when there are several; the learners PACK, on one node where they fit). On a GPU cluster the
bundles hold GPUs; here, CPUs. A group that cannot be placed within the start-up
timeout is reported with what it needed and what the cluster has.
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

    def bundle(self) -> dict[str, float]:
        """Returns one actor's bundle (only the resources it asks for)."""
        bundle = {"CPU": self.cpus, "GPU": self.gpus, **self.custom}
        return {name: amount for name, amount in bundle.items() if amount > 0}


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


class Placement:
    """The placement groups of one run, by role."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.groups: dict[str, Any] = {}
        self.roles: dict[str, RoleResources] = {}

    def reserve(self, resources: RoleResources, timeout_s: float) -> str | None:
        """Creates the role's group and waits until it is placed; returns None, or why
        it could not be placed within timeout_s."""
        bundles = [resources.bundle() for _ in range(resources.count)]
        group = placement_group(
            bundles, strategy=resources.strategy, name=f"{self.run_id}-{resources.role}"
        )
        self.groups[resources.role] = group
        self.roles[resources.role] = resources
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if ready:
            return None
        return (
            f"{resources.role}: no room within {timeout_s:.0f} s for {resources.count} x "
            f"{bundles[0]} ({resources.strategy}); the cluster has {ray.cluster_resources()}"
        )

    def actor_options(self, role: str, index: int) -> dict[str, Any]:
        """Returns the .options() that put the index-th actor of a role in its bundle."""
        resources = self.roles[role]
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.groups[role], placement_group_bundle_index=index
        )
        return {
            "num_cpus": resources.cpus,
            "num_gpus": resources.gpus,
            "resources": dict(resources.custom),
            "scheduling_strategy": strategy,
        }

    def release(self) -> None:
        """Removes every group of the run (their resources go back to the cluster)."""
        for group in self.groups.values():
            remove_placement_group(group)
        self.groups.clear()
