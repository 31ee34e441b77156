"""A Ray cluster of several nodes on this one machine, for tests (ray.cluster_utils).

    python tests/multinode_cluster.py ADDRESS_FILE

Starts a head (1 CPU), two rollout nodes (custom resource rollout_node) and a learner
node (learner_node), writes the cluster's address to ADDRESS_FILE, and keeps it up until
stdin closes. A line `replace rollout` on stdin kills the first rollout node at once (as
a machine that fails) and adds a new one in its place.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ray.cluster_utils import Cluster


def main(address_file: str) -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": 300e6},
    )
    rollout_nodes = [add_node(cluster, "rollout_node"), add_node(cluster, "rollout_node")]
    add_node(cluster, "learner_node")
    cluster.wait_for_nodes()
    Path(address_file).write_text(cluster.address)
    for line in sys.stdin:  # until the test closes our stdin
        if line.strip() == "replace rollout":
            cluster.remove_node(rollout_nodes.pop(0), allow_graceful=False)
            rollout_nodes.append(add_node(cluster, "rollout_node"))
    cluster.shutdown()


def add_node(cluster: Cluster, resource: str):
    return cluster.add_node(num_cpus=1, resources={resource: 1}, object_store_memory=300e6)


if __name__ == "__main__":
    main(sys.argv[1])
