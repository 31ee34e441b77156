"""A Ray cluster of several nodes on this one machine, for tests (ray.cluster_utils).

    python tests/multinode_cluster.py ADDRESS_FILE

Starts a head (1 CPU), two rollout nodes (custom resource rollout_node) and a learner
node (learner_node), writes the cluster's address to ADDRESS_FILE, and keeps it up until
stdin closes.
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
    for resources in ({"rollout_node": 1}, {"rollout_node": 1}, {"learner_node": 1}):
        cluster.add_node(num_cpus=1, resources=resources, object_store_memory=300e6)
    cluster.wait_for_nodes()
    Path(address_file).write_text(cluster.address)
    sys.stdin.read()  # until the test closes our stdin
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
