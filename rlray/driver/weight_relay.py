"""The order in which rollout workers load published weights with rollout.weight_relay:
node by node in a doubling tree, so that no node serves more than one other at a time.

With every worker loading at once, every node pulls the whole object from the
publisher's node, which sends it once per node: the sync grows with size x nodes
(docs/scale.md). Ray pulls an object from any node that holds a copy, and pulls it
once per node however many of its workers ask. Loading in waves makes each wave's
nodes pull from the holders of the waves before: wave k brings the weights to as many
new nodes as hold them already. The number of waves grows with log2(nodes), and the
publisher sends the object log2(nodes) times instead of once per node.
"""

from __future__ import annotations

from typing import Any

import ray

from rlray.cluster.start import Actors
from rlray.driver.recovery import Recovery


def relay_waves(worker_nodes: list[str], source_node: str) -> list[list[int]]:
    """Returns the workers (their indices in `worker_nodes`, the node of each) in the
    waves in which they load: the workers on `source_node` (which holds the published
    object) first; then, wave after wave, the workers of as many new nodes as hold the
    weights so far. Nodes are reached in the order their first worker comes."""
    by_node: dict[str, list[int]] = {}
    for worker, node in enumerate(worker_nodes):
        by_node.setdefault(node, []).append(worker)
    waves = [by_node.pop(source_node, [])]
    waiting = list(by_node.values())  # the workers of each node not yet reached
    holders = 1
    while waiting:
        reached, waiting = waiting[:holders], waiting[holders:]
        waves.append([worker for workers in reached for worker in workers])
        holders += len(reached)
    return [wave for wave in waves if wave]


class NodeRelay:
    """Knows the node of every rollout worker and of the learner (asked of each actor
    once, and again for a worker after its restart) and orders the loads of each sync."""

    def __init__(self, actors: Actors, recovery: Recovery):
        self.actors, self.recovery = actors, recovery
        self.nodes: list[str | None] = [None] * len(actors.rollout)
        self.source: str | None = None

    def waves(self) -> list[list[int]]:
        """This sync's waves (relay_waves), from the learner's node."""
        if self.source is None:
            (handle,) = self.actors.learner.handles[:1]
            self.source = self._node_of("learner", handle)
        for worker, node in enumerate(self.nodes):
            if node is None:
                name, handle = self.actors.rollout_names[worker], self.actors.rollout[worker]
                self.nodes[worker] = self._node_of(name, handle)
        return relay_waves([str(node) for node in self.nodes], self.source)

    def moved(self, worker: int) -> None:
        """A worker was restarted, perhaps on another node: its node is asked again."""
        self.nodes[worker] = None

    def _node_of(self, name: str, handle: Any) -> str:
        return self.recovery.retrying(
            name, lambda: handle.__ray_call__.remote(_node_id), "node lookup"
        )


def _node_id(_: Any) -> str:
    """Runs in an actor: its node's id."""
    return ray.get_runtime_context().get_node_id()
