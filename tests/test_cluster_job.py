"""The job on Ray the way clusters run it: actors placed across several nodes by
placement groups, and a rollout node that dies mid-run (rlray's metrics in the node's
Prometheus export: tests/test_job.py, during its GRPO run)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.jobs_helper import REPO, SHORT_RUN, metrics
from tests.test_faults import attempts, check_whole_batches, steps_logged
from tests.test_store_job import start_job, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def multinode_cluster(tmp_path, job_env):
    address_file = tmp_path / "address"
    cluster = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "multinode_cluster.py"), str(address_file)],
        cwd=REPO,
        env={k: v for k, v in job_env.items() if k != "RAY_ADDRESS"},
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not address_file.exists():
        assert cluster.poll() is None and time.monotonic() < deadline, "cluster did not start"
        time.sleep(1)
    yield address_file.read_text(), cluster.stdin
    cluster.stdin.close()
    try:
        cluster.wait(timeout=120)
    except subprocess.TimeoutExpired:
        cluster.kill()


def test_placement_groups_spread_rollouts_and_a_failed_rollout_node_is_replaced(
    multinode_cluster, job_env, tmp_path
):
    """Placement on three kinds of node, then a rollout node dies mid-run (a new one
    joins): the rollout worker it held restarts there and the run completes, every
    scored episode stored once and every step's batch trained once."""
    address, cluster_commands = multinode_cluster
    run_dir = tmp_path / "placed"
    args = [
        *SHORT_RUN,
        "--learner.steps",
        "6",
        "--run-dir",
        str(run_dir),
        "--rollout.num_workers",
        "2",
        "--rollout.resources",
        "{rollout_node: 1}",
        "--rollout.placement_strategy",
        "STRICT_SPREAD",
        "--learner.resources",
        "{learner_node: 1}",
    ]
    job = start_job(args, {**job_env, "RAY_ADDRESS": address})
    try:
        wait_until(lambda: steps_logged(run_dir) >= 2)
        cluster_commands.write("replace rollout\n")
        cluster_commands.flush()
        _, err = job.communicate(timeout=900)
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    assert "rollout-0 restarted" in err or "rollout-1 restarted" in err, err[-3000:]
    by_batch = check_whole_batches(attempts(run_dir))
    assert {batch: trained.count(True) for batch, trained in by_batch.items() if batch < 6} == (
        dict.fromkeys(range(6), 1)
    )
    placement = json.loads((run_dir / "placement.json").read_text())
    nodes = {name: where["node"] for name, where in placement.items()}
    assert nodes["rollout-0"] != nodes["rollout-1"]  # spread over the two rollout nodes
    assert nodes["learner"] not in {nodes["rollout-0"], nodes["rollout-1"]}
    for record in metrics(run_dir):  # every worker loaded every new version
        assert record["weight_versions_loaded"] == {
            "rollout-0": record["step"],
            "rollout-1": record["step"],
        }
