"""The job on Ray the way clusters run it: rlray's metrics in the node's Prometheus
export while a job runs, and actors placed across several nodes by placement groups."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict

import pytest

from rlray.telemetry import METRICS
from tests.jobs_helper import REPO, SHORT_RUN, metrics
from tests.test_faults import attempts, check_whole_batches, steps_logged
from tests.test_store_job import start_job, wait_until

pytestmark = pytest.mark.slow

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Returns (series, labels, value) of every labelled sample at a Prometheus endpoint."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = dict(LABEL.findall(match["labels"]))
            samples.append((match["name"], labels, float(match["value"])))
    return samples


def series_name(name: str, kind: str) -> str:
    return f"ray_{name}" + {"counter": "_total", "histogram": "_count"}.get(kind, "")


def test_every_metric_reaches_prometheus_with_plausible_values(ray_cluster, job_env, tmp_path):
    run_dir = tmp_path / "metrics-run"
    job = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "jobs" / "ppo.py"),
            *SHORT_RUN,
            "--learner.steps",
            "40",
            "--learner.eval_every",
            "2",
            # Dynamic sampling, so that the reward workers count the groups they drop.
            "--algorithm.advantage",
            "grpo",
            "--algorithm.drop_uniform_groups",
            "true",
            "--run-dir",
            str(run_dir),
        ],
        cwd=REPO,
        env=job_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wanted = {series_name(name, kind): name for name, (kind, _, _) in METRICS.items()}
    seen: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    try:
        while job.poll() is None and set(wanted) - set(seen):
            time.sleep(2)
            try:
                samples = scrape(ray_cluster.metrics_url)
            except OSError:  # the head's metrics agent may not be listening yet
                continue
            for series, labels, value in samples:
                if series in wanted and labels.get("run_id") == run_dir.name:
                    seen[series].append((labels, value))
    finally:
        job.terminate()
        job.wait(timeout=300)
    assert set(seen) == set(wanted), f"never exported: {sorted(set(wanted) - set(seen))}"

    def values(name: str, kind: str = "gauge") -> list[float]:
        return [value for _, value in seen[series_name(name, kind)]]

    assert max(values("rlray_rollout_tokens_per_second")) > 0
    assert max(values("rlray_episodes_generated", "counter")) >= 32
    assert max(values("rlray_episodes_scored", "counter")) >= 32
    assert all(0 <= v <= 1024 for v in values("rlray_buffer_depth"))
    assert values("rlray_dropped_stale") and all(v == 0 for v in values("rlray_dropped_stale"))
    assert max(values("rlray_staleness", "histogram")) >= 32  # episodes observed
    assert all(0 <= v <= 1 for v in values("rlray_reward_mean"))
    # Accuracy is right answers over the 40 held-out prompts (data.eval_size): k / 40.
    accuracies = [v * 40 for v in values("rlray_eval_accuracy")]
    assert all(0 <= a <= 40 and abs(a - round(a)) < 1e-4 for a in accuracies), accuracies
    assert all(v > 0 for v in values("rlray_learner_step_seconds"))
    assert all(v > 0 for v in values("rlray_weight_sync_seconds"))
    assert all(0 <= v < 1e-3 for v in values("rlray_logprob_parity_error"))
    workers = {labels["worker"] for labels, _ in seen["ray_rlray_policy_version"]}
    assert workers == {"rollout-0", "learner"}
    assert max(values("rlray_policy_version")) >= 1


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
